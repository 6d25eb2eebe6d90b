"""Math answer grading and the built-in reward functions.

``extract_answer`` finds a completion's final answer (``\\boxed{}``, then
``####``, then the last number), ``answers_equivalent`` compares it with the
reference exactly as numbers (fractions, thousands separators, percent) or as
normalised text. What that fast, exact check does not settle (``1+x`` vs ``x+1``,
``\\frac{\\sqrt2}{2}`` vs ``\\frac{1}{\\sqrt2}``, sets, intervals, ``x=3`` vs ``3``)
goes to ``math-verify`` (the checker TRL and open-r1 use; sympy underneath).
The built-ins, registered by decorator: ``math`` (correctness),
``format`` (an explicit answer or a pattern), ``dapo_overlong`` and ``length``
(length penalties; they read ``metadata["response_length"]`` and
``metadata["finish_reason"]``, which the rollout adds).
"""
from __future__ import annotations

import math
import re
import threading
from fractions import Fraction
from typing import Any, Mapping

from grpo_mega.rewards.registry import register_reward

__all__ = [
    "extract_answer", "parse_number", "answers_equivalent", "math_verify_equivalent",
    "math_reward", "format_reward", "dapo_overlong_reward", "length_reward",
]

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*")
_HASH_RE = re.compile(r"####\s*(.+)")
# A latex fraction, a thousands-grouped number, or a plain number / a/b.
_NUMBER_RE = re.compile(
    r"-?\\[dt]?frac\{[^{}]*\}\{[^{}]*\}"
    r"|-?\d{1,3}(?:,\d{3})+(?:\.\d+)?"
    r"|-?\d+(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?"
    r"|-?\.\d+"
)
_THOUSANDS_RE = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_FRAC_RE = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_FRAC_SHORT_RE = re.compile(r"\\[dt]?frac(\d)(\d)")
_TEXT_RE = re.compile(r"\\(?:text|textbf|mbox|mathrm)\{([^{}]*)\}")


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (nested braces allowed), or None."""
    starts = [m for m in _BOXED_RE.finditer(text)]
    for m in reversed(starts):
        i = m.end()
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1:j].strip()
            continue  # unbalanced: try an earlier one
        # "\boxed 5" form: up to the next whitespace or "$"
        tail = re.match(r"[^\s$]+", text[i:])
        if tail:
            return tail.group(0)
    return None


def _after_hashes(text: str) -> str | None:
    matches = _HASH_RE.findall(text)
    if not matches:
        return None
    return matches[-1].strip().splitlines()[0].strip() if matches[-1].strip() else None


def _last_number(text: str) -> str | None:
    found = _NUMBER_RE.findall(text)
    return found[-1] if found else None


def extract_answer(text: str, allow_last_number: bool = True) -> str | None:
    """The final answer in a completion: ``\\boxed{}``, then ``####``, then
    (if allowed) the last number; None when there is none."""
    for extract in (_last_boxed, _after_hashes):
        ans = extract(text)
        if ans:
            return ans
    return _last_number(text) if allow_last_number else None


def _normalize(ans: str) -> str:
    s = ans.strip()
    s = _TEXT_RE.sub(r"\1", s)  # \text{(A)} -> (A)
    for junk in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\$", "$", "^\\circ", "^{\\circ}"):
        s = s.replace(junk, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\s+", "", s)
    return s.rstrip(".").strip()


def parse_number(ans: str) -> Fraction | None:
    """Exact value of a numeric answer: ``1,234``, ``-0.5``, ``3/4``,
    ``\\frac{3}{4}``, ``1e3``, ``50\\%`` (as 50); None if not a number."""
    s = _normalize(ans)
    s = s.replace("\\%", "").replace("%", "")
    s = _FRAC_SHORT_RE.sub(r"\\frac{\1}{\2}", s)
    m = _FRAC_RE.fullmatch(s.lstrip("-"))
    if m:
        num, den = parse_number(m.group(1)), parse_number(m.group(2))
        if num is None or den is None or den == 0:
            return None
        value = num / den
        return -value if s.startswith("-") else value
    if _THOUSANDS_RE.match(s):
        s = s.replace(",", "")
    if s.count("/") == 1:
        a, b = (parse_number(part) for part in s.split("/"))
        return None if a is None or b is None or b == 0 else a / b
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def answers_equivalent(pred: str, ref: str, rel_tol: float = 1e-6) -> bool:
    """Numeric equivalence when both parse as numbers, else string equality
    after normalisation (whitespace, ``$``, ``\\left``/``\\right``, ...)."""
    a, b = parse_number(pred), parse_number(ref)
    if a is not None and b is not None:
        if a == b:
            return True
        return math.isclose(float(a), float(b), rel_tol=rel_tol, abs_tol=0.0)
    return _normalize(pred) == _normalize(ref)


def _reference_answer(reference: str) -> str:
    # A reference is either a bare answer ("\frac{1}{2}", "72") or a worked
    # solution ending in "#### 72" / "\boxed{72}"; never take its "last
    # number" (that would read "2" out of "\frac{1}{2}").
    return extract_answer(reference, allow_last_number=False) or reference.strip()


def _as_latex(ans: str) -> str:
    return "$" + ans.replace("$", "").strip() + "$"


def math_verify_equivalent(pred: str, ref: str, timeout_s: int = 2) -> bool:
    """``math-verify``'s judgement of ``pred`` against ``ref`` (both extracted answers,
    parsed as LaTeX). Its own timeout is ``signal.alarm``, which only the main thread may
    set: the scoring workers call this there; from any other thread it runs without one
    (the scorer's per-sample deadline is then the only bound). A parse or comparison
    that overruns ``timeout_s`` counts as not equivalent."""
    try:
        from math_verify import parse, verify
    except ImportError as e:  # an install without the dependency
        raise ImportError("the math reward needs math-verify (pip install 'math-verify>=0.8,<0.10'), or "
                          "reward.kwargs {math: {use_math_verify: false}} for the exact grader only") from e
    t = max(1, math.ceil(timeout_s)) if threading.current_thread() is threading.main_thread() else None
    gold = parse(_as_latex(ref), parsing_timeout=t)
    answer = parse(_as_latex(pred), parsing_timeout=t)
    return bool(gold) and bool(answer) and bool(verify(gold, answer, timeout_seconds=t))


# Built-in reward functions

@register_reward("math")
def math_reward(prompt: str, completion: str, reference: str | None, metadata: Mapping[str, Any],
                correct: float = 1.0, incorrect: float = 0.0, allow_last_number: bool = True,
                use_math_verify: bool = True, verify_timeout_s: int = 2) -> float:
    """``correct`` if the completion's final answer equals the reference.

    The exact check (``answers_equivalent``) runs first and settles any pair of plain
    numbers; other non-matching pairs go to ``math-verify`` unless ``use_math_verify``
    is false. ``verify_timeout_s`` bounds each of its parses and comparisons."""
    if reference is None:
        raise ValueError("math reward needs a reference answer (set the dataset's reference field)")
    pred = extract_answer(completion, allow_last_number=allow_last_number)
    if pred is None:
        return incorrect
    ref = _reference_answer(str(reference))
    if answers_equivalent(pred, ref):
        return correct
    if not use_math_verify or (parse_number(pred) is not None and parse_number(ref) is not None):
        return incorrect  # two numbers that differ: sympy would only agree, slowly
    return correct if math_verify_equivalent(pred, ref, verify_timeout_s) else incorrect


def _warm_up_math(use_math_verify: bool = True, **_: Any) -> None:
    """Import sympy/antlr and build the LaTeX parser once per scoring worker (about a
    second), so the first sample's timeout is not spent on it."""
    if use_math_verify:
        math_verify_equivalent("x+1", "1+x")


math_reward.warm_up = _warm_up_math


@register_reward("format")
def format_reward(prompt: str, completion: str, reference: str | None, metadata: Mapping[str, Any],
                  pattern: str | None = None, reward: float = 1.0) -> float:
    """``reward`` if the completion matches ``pattern`` (``re.search``, DOTALL);
    by default, if it states an explicit answer (``\\boxed{}`` or ``####``)."""
    if pattern is not None:
        return reward if re.search(pattern, completion, flags=re.DOTALL) else 0.0
    explicit = extract_answer(completion, allow_last_number=False)
    return reward if explicit else 0.0


def _response_length(metadata: Mapping[str, Any]) -> int:
    if "response_length" not in metadata:
        raise KeyError("length rewards need metadata['response_length'] (set by the rollout)")
    return int(metadata["response_length"])


@register_reward("dapo_overlong")
def dapo_overlong_reward(prompt: str, completion: str, reference: str | None,
                         metadata: Mapping[str, Any], max_length: int, buffer: int,
                         penalty: float = 1.0) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13).

    0 while ``L <= max_length - buffer``; falls linearly to ``-penalty`` at
    ``L = max_length``; ``-penalty`` beyond. ``max_length`` is normally the
    rollout's max new tokens.
    """
    if not 0 < buffer <= max_length:
        raise ValueError(f"dapo_overlong needs 0 < buffer <= max_length, got {buffer}, {max_length}")
    length = _response_length(metadata)
    safe = max_length - buffer
    if length <= safe:
        return 0.0
    if length <= max_length:
        return penalty * (safe - length) / buffer
    return -penalty


@register_reward("length")
def length_reward(prompt: str, completion: str, reference: str | None, metadata: Mapping[str, Any],
                  max_length: int, coef: float = 1.0, truncated_penalty: float = 0.0) -> float:
    """Linear length penalty ``-coef * L / max_length``, plus
    ``-truncated_penalty`` when the response hit the token limit."""
    length = _response_length(metadata)
    value = -coef * length / max_length
    if metadata.get("finish_reason") == "length":
        value -= truncated_penalty
    return value

