"""Tests for grpo_mega.rewards.math: answer extraction and equivalence, and the
built-in reward functions (math, format, dapo_overlong, length).
"""
from __future__ import annotations

import pytest

from grpo_mega.rewards import (
    answers_equivalent, dapo_overlong_reward, extract_answer, format_reward, length_reward, math_reward,
)


# (completion, reference, expected math reward)
MATH_TABLE = [
    (r"so the answer is \boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{\dfrac{3}{4}}.", r"\frac34", 1.0),
    ("The answer is 1,234 apples.", "1234", 1.0),
    ("#### 1,000", "The total is 999 + 1.\n#### 1000", 1.0),
    ("I get -0.25 at the end.", r"-\frac{1}{4}", 1.0),
    ("First 3, then 5, finally 7", "7", 1.0),  # last number wins
    ("First 7, then 5", "7", 0.0),
    ("no answer at all", "5", 0.0),
    ("", "5", 0.0),
    (r"\boxed{\text{(A)}}", "(A)", 1.0),
    (r"\boxed{x + 1}", "x+1", 1.0),
    (r"\boxed{$5$}", "5", 1.0),
    ("3/6", r"\frac{1}{2}", 1.0),
    (r"\boxed{\frac{1}{3}}", "0.333", 0.0),  # not equal, only close
    ("12,34", "1234", 0.0),  # not a thousands separator
    (r"\boxed{2} then later \boxed{3}", "3", 1.0),  # the last boxed answer counts
    (r"\boxed{\frac{1}{2}", "0.5", 1.0),  # unbalanced \boxed{: falls back to the last number
]


@pytest.mark.parametrize("completion,reference,expected", MATH_TABLE)
def test_math_reward_table(completion, reference, expected):
    """Guards the grader against false positives and negatives on the answer forms
    seen in GSM8K/MATH: fractions, thousands separators, \\text, the last \\boxed."""
    assert math_reward("", completion, reference, {}) == expected


def test_extract_answer_prefers_boxed_then_hashes_then_last_number():
    """Guards the extraction order: an earlier stray number must not win over a
    \\boxed or #### answer, and nested braces must not cut the answer short."""
    assert extract_answer(r"3 then \boxed{\frac{1}{2}} then 9") == r"\frac{1}{2}"
    assert extract_answer("3 then #### 42\nextra 9") == "42"
    assert extract_answer("3 then 9.") == "9"
    assert extract_answer("nothing") is None
    assert extract_answer("just 9", allow_last_number=False) is None
    assert extract_answer(r"\boxed{{1, 2}}") == "{1, 2}"  # nested braces


def test_answers_equivalent_numeric_and_textual():
    """Guards against 1e3 != 1,000 style misses, a division by zero on 1/0, and
    latex \\left/\\right making equal tuples differ."""
    assert answers_equivalent("1e3", "1,000")
    assert answers_equivalent("50%", "50")
    assert not answers_equivalent("1/0", "0")
    assert answers_equivalent(r"\left( 1, 2 \right)", "(1,2)")


def test_math_reward_needs_a_reference():
    """Guards against a dataset without references silently scoring every sample 0."""
    with pytest.raises(ValueError, match="needs a reference"):
        math_reward("", "1", None, {})


def test_format_reward():
    """Guards against the format reward paying for a bare number (no explicit
    answer) or ignoring a custom pattern."""
    assert format_reward("", r"so \boxed{3}", None, {}) == 1.0
    assert format_reward("", "#### 3", None, {}) == 1.0
    assert format_reward("", "it is 3", None, {}) == 0.0
    assert format_reward("", "<think>x</think> 3", None, {}, pattern=r"^<think>.*</think>") == 1.0


def test_dapo_overlong_penalty_is_piecewise_linear():
    """DAPO eq. 13 with L_max=20, L_cache=5: 0 up to 15, linear to -1 at 20."""
    f = lambda n: dapo_overlong_reward("", "", None, {"response_length": n}, max_length=20, buffer=5)
    assert [f(n) for n in (0, 15, 16, 20, 21)] == [0.0, 0.0, -0.2, -1.0, -1.0]
    with pytest.raises(KeyError, match="response_length"):
        dapo_overlong_reward("", "", None, {}, max_length=20, buffer=5)


def test_length_reward_with_truncation_penalty():
    """Guards against dropping the truncation penalty or the coef scaling."""
    meta = {"response_length": 10, "finish_reason": "length"}
    assert length_reward("", "", None, meta, max_length=20, coef=0.5, truncated_penalty=1.0) == -1.25
