"""The ``calculator`` environment: one tool that evaluates arithmetic, safely.

:func:`evaluate` never runs code: it parses the expression with :mod:`ast` and walks the
tree itself, accepting only numbers (int, float), unary ``+ -``, binary
``+ - * / // % **`` and parentheses. Sizes are bounded before they are computed: the
expression's length, an exponent whose result would pass ``max_digits`` digits, and
every intermediate result. ``/`` of two integers that divide exactly gives an integer
(``84/4`` -> ``21``), otherwise a float.

The task it is made for: arithmetic a small model cannot do in its head but can with
the tool (multiplying two 3-4 digit numbers). The episode's reward is the ``math``
reward of the final message (its last ``\\boxed{}``, else the text after ``####``, else
its last number, against the row's reference), exact numbers only (no math-verify).
"""
from __future__ import annotations

import ast
import math
import operator
from dataclasses import dataclass
from typing import Any

from grpo_mega.envs.registry import register_env
from grpo_mega.envs.tool_env import ToolEnv
from grpo_mega.envs.types import Tool

__all__ = ["CalculatorError", "evaluate", "CalculatorEnv"]

Number = int | float


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, or its result is out of bounds."""


def _div(a: Number, b: Number) -> Number:
    if isinstance(a, int) and isinstance(b, int) and b != 0 and a % b == 0:
        return a // b
    return a / b


_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: _div,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_HINTS = {ast.BitXor: " (use ** for powers)", ast.Tuple: " (write numbers without thousands separators)"}


def _check_size(value: Any, max_digits: int) -> Number:
    if isinstance(value, complex):
        raise CalculatorError("the result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is too large")
    if isinstance(value, int) and value.bit_length() > max_digits * 3.33:
        raise CalculatorError(f"the result has more than {max_digits} digits")
    return value


def _check_power(base: Number, exp: Number, max_digits: int) -> None:
    """Refuse ``base ** exp`` before computing it when its size would pass ``max_digits``
    (``9 ** 10 ** 8`` would otherwise take the process's memory and minutes)."""
    try:
        digits = abs(exp) * math.log10(abs(base)) if abs(base) > 1 else 0.0
    except OverflowError:  # an exponent beyond a float
        digits = math.inf
    if digits > max_digits + 1:
        raise CalculatorError(f"the result of ** has more than {max_digits} digits")


def _eval(node: ast.AST, max_digits: int) -> Number:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _check_size(node.value, max_digits)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand, max_digits))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        a, b = _eval(node.left, max_digits), _eval(node.right, max_digits)
        if isinstance(node.op, ast.Pow):
            _check_power(a, b, max_digits)
        try:
            return _check_size(_BINOPS[type(node.op)](a, b), max_digits)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("the result is too large") from None
    what = type(node.op if isinstance(node, (ast.BinOp, ast.UnaryOp)) else node)
    raise CalculatorError(f"only numbers, + - * / // % ** and parentheses are allowed, not "
                          f"{what.__name__}{_HINTS.get(what, '')}")


def evaluate(expression: str, max_chars: int = 200, max_digits: int = 100) -> Number:
    """The value of an arithmetic expression; :class:`CalculatorError` (with a message
    for the model) when it is not plain arithmetic or out of bounds."""
    text = expression.strip().replace("×", "*").replace("÷", "/")
    if len(text) > max_chars:
        raise CalculatorError(f"the expression is longer than {max_chars} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError):
        raise CalculatorError("not an arithmetic expression") from None
    return _eval(tree.body, max_digits)


@register_env("calculator")
@dataclass(eq=False)
class CalculatorEnv(ToolEnv):
    """Answer a question with a ``calculator(expression)`` tool; scored by the math reward."""

    reward: Any = ({"name": "math", "kwargs": {"use_math_verify": False}},)
    """As in :class:`ToolEnv`; here exact numbers only (math-verify off)."""
    max_chars: int = 200
    """Longest expression the tool evaluates."""
    max_digits: int = 100
    """Largest result (and intermediate result) in decimal digits."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.tools = [Tool(
            name="calculator",
            description="Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
            parameters={"type": "object", "required": ["expression"],
                        "properties": {"expression": {"type": "string", "description": "e.g. 123 * 4567"}}},
            fn=self.calculate)]

    def calculate(self, expression: str) -> str:
        """The tool: the value as text, or ``error: ...``."""
        try:
            return str(evaluate(expression, self.max_chars, self.max_digits))
        except CalculatorError as e:
            return f"error: {e}"
