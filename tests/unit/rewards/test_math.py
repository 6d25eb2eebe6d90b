"""Tests for grpo_mega.rewards.math: answer extraction and equivalence (the exact check,
then math-verify), and the built-in reward functions (math, format, dapo_overlong, length).
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

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


@pytest.mark.parametrize("use_math_verify", [True, False])
@pytest.mark.parametrize("completion,reference,expected", MATH_TABLE)
def test_math_reward_table(completion, reference, expected, use_math_verify):
    """Guards the grader against false positives and negatives on the answer forms
    seen in GSM8K/MATH: fractions, thousands separators, \\text, the last \\boxed; with
    math-verify behind the exact check and without it, the same verdict on each."""
    assert math_reward("", completion, reference, {}, use_math_verify=use_math_verify) == expected


# (completion, reference, with math-verify, exact check only): forms only a symbolic
# checker settles, and near-misses it must still refuse.
MATH_VERIFY_TABLE = [
    (r"\boxed{1+x}", "x+1", 1.0, 0.0),
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}", 1.0, 0.0),
    (r"\boxed{\{1,2\}}", r"\{2,1\}", 1.0, 0.0),
    (r"so $x = 3$, \boxed{x=3}", "3", 1.0, 0.0),  # math-verify reads the assignment's value
    (r"\boxed{2\pi}", r"2 \pi", 1.0, 1.0),
    (r"\boxed{(1,2)}", "(2,1)", 0.0, 0.0),  # an ordered pair is not its reverse
    # gold first: an interval answers an inequality question, not the reverse (math-verify's rule)
    (r"\boxed{(1,2)}", "1<x<2", 1.0, 0.0),
    (r"\boxed{1<x<2}", "(1,2)", 0.0, 0.0),
    (r"\boxed{\text{(B)}}", "(A)", 0.0, 0.0),
    (r"\boxed{x+2}", "x+1", 0.0, 0.0),
    (r"\boxed{y+1}", "x+1", 0.0, 0.0),  # variables matter (strict)
]


@pytest.mark.parametrize("completion,reference,with_mv,exact_only", MATH_VERIFY_TABLE)
def test_math_verify_settles_symbolic_answers(completion, reference, with_mv, exact_only):
    """Guards against the math reward missing equivalent symbolic answers (x+1 vs 1+x,
    rationalised roots, sets) that the exact check cannot see, and against math-verify
    passing near-misses; use_math_verify=false must keep the exact grader's verdicts."""
    assert math_reward("", completion, reference, {}) == with_mv
    assert math_reward("", completion, reference, {}, use_math_verify=False) == exact_only


def test_exact_and_numeric_answers_never_load_math_verify():
    """Guards the fast path: answers the exact check settles, and wrong plain numbers
    (most GSM8K-style misses), must not pay for sympy; only a symbolic pair loads it."""
    root = Path(__file__).resolve().parents[3]
    code = ("import sys\n"
            "from grpo_mega.rewards import math_reward\n"
            "for c, r in [(r'\\boxed{\\frac{1}{2}}', '0.5'), ('#### 1,000', '1000'), ('so 41', '42'),"
            " (r'\\boxed{\\frac{1}{3}}', '0.333'), (r'\\boxed{\\text{(A)}}', '(A)')]:\n"
            "    math_reward('', c, r, {})\n"
            "print('math_verify' in sys.modules, 'sympy' in sys.modules)\n"
            "math_reward('', r'\\boxed{1+x}', 'x+1', {})\n"
            "print('math_verify' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False", "True"], out.stdout


def test_math_verify_runs_outside_the_main_thread():
    """Guards against math-verify's signal.alarm timeout raising ValueError ("signal only
    works in main thread") when the reward is called from a thread (inline scoring)."""
    got = []
    worker = threading.Thread(target=lambda: got.append(math_reward("", r"\boxed{1+x}", "x+1", {})))
    worker.start()
    worker.join(60)
    assert got == [1.0]


def test_math_verify_timeout_scores_incorrect_inside_scoring_workers():
    """Guards against a pathological answer (a power tower sympy tries to evaluate) either
    hanging the worker until the scorer kills it, which stops the run under
    on_error=stop, or raising: math-verify's own alarm must fire in the worker and the
    sample score incorrect, while a symbolic answer in the same batch still scores."""
    from grpo_mega.rewards import RewardSample, score_samples

    batch = [RewardSample("p", r"\boxed{9^{9^{9^{9}}}}", "1"), RewardSample("p", r"\boxed{1+x}", "x+1"),
             RewardSample("p", "#### 7", "7")]
    start = time.monotonic()
    result = score_samples(batch, [{"name": "math", "kwargs": {"verify_timeout_s": 1}}],
                           num_workers=1, timeout_s=10.0)
    assert result.failures == [] and result.scores == [0.0, 1.0, 1.0]
    assert time.monotonic() - start < 30


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
