"""Tools a model can call during a multi-turn rollout (:mod:`hybridflow.rollout.multi_turn`).

The :class:`Tool` interface and its registry (:func:`register_tool`, :data:`TOOLS`), the tool-call formats
(:mod:`hybridflow.tools.formats`), the tool config file (:func:`load_tools`) and the built-in tools
``calculator`` (safe arithmetic) and ``http`` (POST to a user's service). User tools register from a module
listed in ``trainer.plugins``.
"""

from hybridflow.tools.base import TOOLS, Tool, ToolCall, ToolError, get_tool_class, register_tool, run_calls
from hybridflow.tools.calculator import CalculatorTool, evaluate
from hybridflow.tools.config import load_tools
from hybridflow.tools.formats import TOOL_FORMATS, HermesFormat, ToolCallFormat, get_tool_format
from hybridflow.tools.http import HttpTool

__all__ = [
    "CalculatorTool", "HermesFormat", "HttpTool", "TOOLS", "TOOL_FORMATS", "Tool", "ToolCall", "ToolCallFormat",
    "ToolError", "evaluate", "get_tool_class", "get_tool_format", "load_tools", "register_tool", "run_calls",
]
