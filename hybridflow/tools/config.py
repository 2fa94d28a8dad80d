"""The tool config file (``actor_rollout_ref.rollout.multi_turn.tool_config_path``).

YAML (or JSON) with one list, ``tools``; each entry names a registered tool and its config::

    tools:
      - name: calculator
      - name: http
        config: {url: "http://127.0.0.1:8000/search", name: search, description: "Search the web",
                 parameters: {type: object, properties: {query: {type: string}}, required: [query]}}

Without a file, the ``calculator`` alone is used.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

from omegaconf import OmegaConf

from hybridflow.errors import UserError
from hybridflow.tools.base import Tool, get_tool_class

__all__ = ["DEFAULT_TOOLS", "load_tools", "multi_turn_problems", "prompt_tool_schemas"]

DEFAULT_TOOLS = ({"name": "calculator"},)


def load_tools(path: Optional[str]) -> dict[str, Tool]:
    """The tools of the config file at ``path`` (None: :data:`DEFAULT_TOOLS`), keyed by the name the model
    calls them by (the schema's function name).

    Raises:
        UserError: the file is unreadable or malformed, an entry names an unknown tool (the message lists the
            registered ones), or two tools share a name.
    """
    entries: Any = DEFAULT_TOOLS
    if path:
        try:
            loaded = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
        except (OSError, ValueError) as err:
            raise UserError(f"multi_turn.tool_config_path {path!r}: cannot read ({err})") from None
        entries = loaded.get("tools") if isinstance(loaded, dict) else None
        if not isinstance(entries, list) or not entries:
            raise UserError(f"multi_turn.tool_config_path {path!r}: expected a non-empty list under 'tools'")
    tools: dict[str, Tool] = {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise UserError(f"tool config entry {i} must be a mapping with a string 'name', got {entry!r}")
        try:
            tool = get_tool_class(entry["name"])(entry.get("config") or {})
        except (KeyError, ValueError) as err:
            raise UserError(f"tool config entry {i} ({entry['name']!r}): {err}") from None
        called = tool.schema["function"]["name"]
        if called in tools:
            raise UserError(f"two tools in the tool config are called {called!r}")
        tools[called] = tool
    return tools


def prompt_tool_schemas(config: Any) -> Optional[list[dict]]:
    """The tool schemas prompts are rendered with (``tools=`` of the chat template) when the run config's
    ``actor_rollout_ref.rollout.multi_turn.enable`` is set, else None.

    Raises:
        UserError: see :func:`load_tools`.
    """
    cfg = config.actor_rollout_ref.rollout.multi_turn
    return [tool.schema for tool in load_tools(cfg.tool_config_path).values()] if cfg.enable else None


def multi_turn_problems(get: Callable[[str], Any]) -> list[str]:
    """Config problems of ``actor_rollout_ref.rollout.multi_turn`` found at load (before Ray starts): counts and
    timeouts out of range, a tool config file that does not exist. (Tool names are checked when the workers
    build the tools: user tools register from ``trainer.plugins``.)"""
    key = "actor_rollout_ref.rollout.multi_turn"
    problems = []
    if get(f"{key}.max_user_turns") < 0:
        problems.append(f"{key}.max_user_turns: must be >= 0, got {get(f'{key}.max_user_turns')}")
    if not get(f"{key}.tool_timeout_s") > 0:
        problems.append(f"{key}.tool_timeout_s: must be > 0, got {get(f'{key}.tool_timeout_s')}")
    path = get(f"{key}.tool_config_path")
    if path and not os.path.isfile(path):
        problems.append(f"{key}.tool_config_path: no file {path!r}")
    return problems
