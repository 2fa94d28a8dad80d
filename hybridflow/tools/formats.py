"""Tool-call formats: how a model writes a call, where its turn stops, how a call is parsed.

Selected by ``actor_rollout_ref.rollout.multi_turn.format`` (registry :data:`TOOL_FORMATS`). Built in:
``hermes`` (Qwen2 / Hermes chat templates): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the
turn stops at ``</tool_call>``. A user format is a :class:`ToolCallFormat` subclass registered with
``@TOOL_FORMATS.register("name")`` in a ``trainer.plugins`` module.
"""

from __future__ import annotations

import json
import re
from typing import ClassVar

from hybridflow.registry import Registry
from hybridflow.tools.base import ToolCall

__all__ = ["HermesFormat", "TOOL_FORMATS", "ToolCallFormat", "get_tool_format"]


class ToolCallFormat:
    """A tool-call syntax: ``stop`` strings end a model turn (the stop text is kept: the model sampled it);
    :meth:`parse` extracts the calls of one turn's text."""

    stop: ClassVar[tuple[str, ...]] = ()

    def parse(self, text: str) -> list[ToolCall]:
        """The complete calls in ``text``, in order; a call that cannot be parsed has ``name=None`` and
        ``error`` set."""
        raise NotImplementedError


TOOL_FORMATS: Registry = Registry("tool-call format")


@TOOL_FORMATS.register("hermes")
class HermesFormat(ToolCallFormat):
    """``<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>`` (``arguments``
    may also be a JSON string holding the object, as some models write it; an empty string, as APIs write a call
    without arguments, is the empty object ``{}``)."""

    stop = ("</tool_call>",)
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> list[ToolCall]:
        return [self._parse_one(match.group(1).strip()) for match in self._CALL.finditer(text)]

    @staticmethod
    def _parse_one(body: str) -> ToolCall:
        try:
            obj = json.loads(body)
        except ValueError as err:
            return ToolCall(name=None, text=body, error=f"tool call is not valid JSON ({err.msg})")
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return ToolCall(name=None, text=body, error='tool call must be a JSON object with a string "name"')
        arguments = obj.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                pass
        if not isinstance(arguments, dict):
            return ToolCall(name=obj["name"], text=body, error='tool call "arguments" must be a JSON object')
        return ToolCall(name=obj["name"], arguments=arguments, text=body)


def get_tool_format(name: str) -> ToolCallFormat:
    """An instance of the format registered as ``name``.

    Raises:
        UnknownNameError: unknown format (the message lists the known ones).
    """
    return TOOL_FORMATS.get(name)()
