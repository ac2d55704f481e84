"""A calculator tool for multi-turn rollouts: safe arithmetic on numbers, and the call a model's text makes to it.

``calculate`` parses with ``ast.parse(mode="eval")`` and walks the tree itself, allowing only numbers (int and float
literals, not bool or complex), unary + and -, the binary operators ``+ - * / // % **`` and parentheses; nothing the
model writes is ever passed to eval, exec or compile. It never raises: a failure is a one-line observation starting
with ``error: ``. Powers are checked before they are computed (an int ``a ** b`` is refused when ``b * log10(|a|)``
passes ``max_result_digits``), every result is checked after, floats that overflow are refused rather than printed
as inf, and nesting is bounded (Python's parser refuses more than 200 parentheses; the walk refuses more than
``MAX_DEPTH`` operators deep).
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

MAX_DEPTH = 100  # operators nested in one another; deeper trees are refused before they are walked
ALLOWED = "error: only numbers and + - * / // % ** ( ) are allowed"
_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[float], float]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class _Refused(Exception):
    """Carries the observation for an expression that cannot be evaluated."""


def calculate(expression: str, *, max_chars: int = 200, max_result_digits: int = 1000) -> str:
    """The value of an arithmetic expression as text (an integral result prints as an int), or ``error: ...``."""
    if len(expression) > max_chars:
        return f"error: expression longer than {max_chars} characters"
    if not expression.strip():
        return "error: empty expression; write e.g. 2 * (3 + 4)"
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        if "nested" in str(e.msg):
            return "error: expression nested too deeply"
        return f"error: not an arithmetic expression ({e.msg})"
    except (RecursionError, MemoryError):  # the parser's or the AST builder's stack, exhausted by nesting
        return "error: expression nested too deeply"
    try:
        return _format(_evaluate(tree.body, 0, max_result_digits), max_result_digits)
    except _Refused as e:
        return str(e)
    except ZeroDivisionError:
        return "error: division by zero"
    except OverflowError:
        return "error: result too large"


def _evaluate(node: ast.expr, depth: int, max_digits: int) -> int | float:
    if depth > MAX_DEPTH:
        raise _Refused("error: expression nested too deeply")
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise _Refused(ALLOWED)
        return _checked(node.value, max_digits)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand, depth + 1, max_digits))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left = _evaluate(node.left, depth + 1, max_digits)
        right = _evaluate(node.right, depth + 1, max_digits)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right, max_digits)
        result = _BINARY[type(node.op)](left, right)
        if isinstance(result, complex):
            raise _Refused("error: result is not a real number (a negative number to a fractional power)")
        return _checked(result, max_digits)
    raise _Refused(ALLOWED)


def _check_power(base: int | float, exponent: int | float, max_digits: int) -> None:
    """Refuses an int power whose result would pass max_digits, before it is computed; float powers are O(1) and
    raise OverflowError themselves."""
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        if exponent * math.log10(abs(base)) > max_digits:
            raise _Refused("error: result too large")


def _checked(value: int | float, max_digits: int) -> int | float:
    if isinstance(value, float) and not math.isfinite(value):
        raise _Refused("error: result too large")
    if isinstance(value, int) and value.bit_length() * math.log10(2) > max_digits + 1:
        raise _Refused("error: result too large")
    return value


def _format(value: int | float, max_digits: int) -> str:
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e16:  # 6/3 -> "2"; past 1e16 a float no longer holds every integer
            return str(int(value))
        return f"{value:.12g}"  # 0.1 + 0.2 -> "0.3"
    try:
        text = str(value)
    except ValueError:  # past sys.get_int_max_str_digits(), when max_result_digits is set above it
        return "error: result too large"
    return "error: result too large" if len(text.lstrip("-")) > max_digits else text


def extract_call(text: str, tag: str = "calc") -> str | None:
    """The contents of the last complete ``<tag>...</tag>`` in a model's text, stripped; None when there is none."""
    opening, closing = f"<{tag}>", f"</{tag}>"
    end = text.rfind(closing)
    start = text.rfind(opening, 0, end) if end >= 0 else -1
    return None if start < 0 else text[start + len(opening) : end].strip()
