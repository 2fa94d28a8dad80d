"""``calculator``: a safe arithmetic evaluator over Python's ``ast`` (no ``eval``, bounded work).

Accepted: int and float literals, ``+ - * / // %`` and ``**``, unary ``+``/``-`` and parentheses. Anything else
(names, calls, attributes, strings, comparisons ...) is rejected before evaluation. Bounds: the expression has at
most :data:`MAX_CHARS` characters and :data:`MAX_NODES` syntax nodes, an exponent is at most :data:`MAX_EXPONENT`
in magnitude, and every intermediate result is at most :data:`MAX_MAGNITUDE` in magnitude, so no call can take
long or allocate a huge integer.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any, Optional, Union

from hybridflow.tools.base import Tool, ToolError, register_tool

__all__ = ["CalculatorTool", "evaluate"]

MAX_CHARS = 200
MAX_NODES = 64
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e30

Number = Union[int, float]
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _bounded(value: Number) -> Number:
    if not isinstance(value, (int, float)):  # a complex power such as (-8) ** 0.5
        raise ToolError(f"cannot compute: the result {value!r} is not a real number")
    if isinstance(value, float) and not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
        raise ToolError(f"result out of range (|x| > {MAX_MAGNITUDE:g})")
    return value


def _eval(node: ast.AST) -> Number:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ToolError(f"exponent {right:g} too large (max {MAX_EXPONENT})")
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except (OverflowError, TypeError) as err:  # TypeError: a complex result (negative base, fractional power)
            raise ToolError(f"cannot compute: {err}") from None
    raise ToolError(f"unsupported syntax {type(node).__name__}: only numbers, + - * / // % ** and parentheses")


def evaluate(expression: str) -> Number:
    """The value of an arithmetic ``expression``.

    Raises:
        ToolError: not a string, too long or too complex, unsupported syntax, division by zero, an exponent or
            value out of bounds.
    """
    if not isinstance(expression, str):
        raise ToolError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_CHARS:
        raise ToolError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ToolError(f"not an arithmetic expression: {expression!r}") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise ToolError(f"expression has more than {MAX_NODES} syntax nodes")
    return _eval(tree.body)


def format_number(value: Number) -> str:
    """``12`` for integral values (also ``12.0``), else up to 10 significant digits (``0.3333333333``)."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value) if isinstance(value, int) else format(value, ".10g")


@register_tool("calculator")
class CalculatorTool(Tool):
    """Evaluates ``{"expression": "12 * (3 + 4)"}`` and returns the number as text (``"84"``)."""

    description = "Evaluate an arithmetic expression with + - * / // % ** and parentheses."
    parameters = {"type": "object",
                  "properties": {"expression": {"type": "string", "description": "e.g. 12 * (3 + 4)"}},
                  "required": ["expression"]}

    async def call(self, arguments: dict[str, Any], *, instance_id: Optional[str] = None) -> str:
        if "expression" not in arguments:
            raise ToolError("missing argument 'expression'")
        return format_number(evaluate(arguments["expression"]))
