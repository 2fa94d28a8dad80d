"""The tool contract, its registry, and running a round of tool calls.

A tool is a class registered with :func:`register_tool` under its ``name``. The multi-turn rollout
(:mod:`hybridflow.rollout.multi_turn`) builds one instance per tool listed in
``actor_rollout_ref.rollout.multi_turn.tool_config_path`` and, per trajectory:

1. ``await tool.create(instance_id, sample)`` once before the first call (optional per-trajectory state;
   ``sample`` holds the row's ``ground_truth``/``extra_info`` when the batch has them);
2. ``await tool.call(arguments, instance_id=instance_id) -> str`` for each call the model makes;
3. ``await tool.release(instance_id)`` once the trajectory is finished.

The JSON schema (:attr:`Tool.schema`) is what the chat template's ``tools=`` receives, so the model sees the
tools in its prompt. A call that raises, times out, names an unknown tool or cannot be parsed never stops the
rollout: its observation is an error text (``"Error: ..."``) and it counts in ``tool/errors``.

User tools: subclass :class:`Tool`, decorate with ``@register_tool("name")`` in a module listed in
``trainer.plugins`` (imported on the driver and in every worker), and list the name in the tool config.
"""

from __future__ import annotations

import abc
import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional

from hybridflow.registry import Registry

__all__ = ["TOOLS", "Tool", "ToolCall", "ToolError", "get_tool_class", "register_tool", "run_calls"]


class ToolError(Exception):
    """Raised by a tool for a call it cannot serve (bad arguments, service error); the message becomes the
    observation text."""


class Tool(abc.ABC):
    """One callable tool.

    Args:
        config: the tool's ``config`` mapping from the tool config file (tool-specific keys).

    Class attributes a subclass sets: ``name`` (set by :func:`register_tool`), ``description`` and
    ``parameters`` (a JSON-schema object of the arguments), which make :attr:`schema`.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    parameters: ClassVar[dict[str, Any]] = {"type": "object", "properties": {}}

    def __init__(self, config: Optional[dict[str, Any]] = None) -> None:
        self.config = dict(config or {})

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function schema passed to ``tokenizer.apply_chat_template(..., tools=[...])``."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    async def create(self, instance_id: str, sample: dict[str, Any]) -> None:
        """Set up per-trajectory state for ``instance_id`` (default: none)."""

    @abc.abstractmethod
    async def call(self, arguments: dict[str, Any], *, instance_id: Optional[str] = None) -> str:
        """Run one call and return the observation text.

        Raises:
            ToolError (or any exception): the rollout turns it into an error observation.
        """

    async def release(self, instance_id: str) -> None:
        """Free the state of ``instance_id`` (default: nothing)."""


def _check_tool(name: str, cls: Any) -> None:
    if not (isinstance(cls, type) and issubclass(cls, Tool)):
        raise TypeError(f"register_tool({name!r}) expects a Tool subclass, got {cls!r}")


TOOLS: Registry = Registry("tool", check=_check_tool)


def register_tool(name: str, **meta: Any) -> Callable[[type[Tool]], type[Tool]]:
    """Class decorator registering a :class:`Tool` subclass under ``name`` (also set as its ``name``).

    Raises:
        ValueError: ``name`` is taken by another class.
        TypeError: the class is not a :class:`Tool` subclass.
    """
    register = TOOLS.register(name, **meta)

    def decorator(cls: type[Tool]) -> type[Tool]:
        register(cls)
        cls.name = name
        return cls

    return decorator


def get_tool_class(name: str) -> type[Tool]:
    """The tool class registered as ``name``.

    Raises:
        UnknownNameError: unknown name (the message lists the registered tools and the nearest).
    """
    return TOOLS.get(name)


@dataclass
class ToolCall:
    """One call the model made and what came back.

    ``name``/``arguments`` as parsed (``name`` is None when the call text could not be parsed, ``text`` is the
    raw call text); ``result`` the observation text; ``error`` the error message (None on success);
    ``latency_s`` wall seconds of the call (0 for calls that never ran).
    """

    name: Optional[str]
    arguments: dict[str, Any] = field(default_factory=dict)
    text: str = ""
    result: str = ""
    error: Optional[str] = None
    latency_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": self.arguments, "result": self.result, "error": self.error,
                "latency_s": self.latency_s}


async def _run_one(call: ToolCall, tools: dict[str, Tool], instance_id: str, timeout_s: float,
                   max_chars: int) -> None:
    await _execute(call, tools, instance_id, timeout_s)
    if call.error is not None:
        call.result = f"Error: {call.error}"
    call.result = call.result[:max_chars]


async def _execute(call: ToolCall, tools: dict[str, Tool], instance_id: str, timeout_s: float) -> None:
    """Run ``call`` (unless it could not be parsed), setting ``result`` or ``error``, and ``latency_s``."""
    if call.error is not None:
        return
    tool = tools.get(call.name)
    if tool is None:
        call.error = f"unknown tool {call.name!r}; available: {', '.join(sorted(tools)) or '(none)'}"
        return
    start = time.perf_counter()
    try:
        result = await asyncio.wait_for(tool.call(call.arguments, instance_id=instance_id), timeout_s)
        if not isinstance(result, str):
            raise ToolError(f"tool {call.name!r} returned {type(result).__name__}, expected str")
        call.result = result
    except asyncio.TimeoutError:
        call.error = f"tool {call.name!r} timed out after {timeout_s:g}s"
    except Exception as err:  # noqa: BLE001 - any tool failure becomes an observation, never a crash
        call.error = f"{type(err).__name__}: {err}"
    call.latency_s = time.perf_counter() - start


async def run_calls(rounds: list[tuple[str, list[ToolCall]]], tools: dict[str, Tool], timeout_s: float,
                    max_chars: int) -> None:
    """Run every call of every trajectory concurrently, each under ``timeout_s`` seconds; fills each
    :class:`ToolCall`'s ``result``/``error``/``latency_s`` in place. A failed call's result is
    ``"Error: <error>"``; every result is cut to ``max_chars`` characters.

    Args:
        rounds: ``(instance_id, calls)`` per trajectory that made calls this turn.
    """
    await asyncio.gather(*(_run_one(call, tools, iid, timeout_s, max_chars)
                           for iid, calls in rounds for call in calls))
