"""Rule-based rewards: answer extraction and equivalence, built-in rewards,
the registry, the sandboxed scorer's error/timeout policies, dynamic sampling.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/rewards/test_rewards.py

The custom reward functions below are imported by name in spawned worker
processes ("tests.unit.rewards.test_rewards:..."), so they must stay at module level.
"""
from __future__ import annotations

import time

import pytest

from grpo_mega.rewards import (
    REWARD_REGISTRY, RewardError, RewardSample, RewardScorer, answers_equivalent, dapo_overlong_reward,
    extract_answer, filter_uniform_groups, format_reward, length_reward, math_reward, register_reward,
    resolve_reward, score_samples,
)


def raising_reward(prompt, completion, reference, metadata, **kwargs):
    if "boom" in completion:
        raise ZeroDivisionError("reward exploded on purpose")
    return 1.0


def sleepy_reward(prompt, completion, reference, metadata, **kwargs):
    if "hang" in completion:
        while True:  # a reward stuck forever: the worker must be killed
            time.sleep(0.05)
    return 0.5


def weighted_echo(prompt, completion, reference, metadata, scale=1.0):
    return scale * len(completion)


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
    assert math_reward("", completion, reference, {}) == expected


def test_extract_answer_prefers_boxed_then_hashes_then_last_number():
    assert extract_answer(r"3 then \boxed{\frac{1}{2}} then 9") == r"\frac{1}{2}"
    assert extract_answer("3 then #### 42\nextra 9") == "42"
    assert extract_answer("3 then 9.") == "9"
    assert extract_answer("nothing") is None
    assert extract_answer("just 9", allow_last_number=False) is None
    assert extract_answer(r"\boxed{{1, 2}}") == "{1, 2}"  # nested braces


def test_answers_equivalent_numeric_and_textual():
    assert answers_equivalent("1e3", "1,000")
    assert answers_equivalent("50%", "50")
    assert not answers_equivalent("1/0", "0")
    assert answers_equivalent(r"\left( 1, 2 \right)", "(1,2)")


def test_math_reward_needs_a_reference():
    with pytest.raises(ValueError, match="needs a reference"):
        math_reward("", "1", None, {})


def test_format_reward():
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
    meta = {"response_length": 10, "finish_reason": "length"}
    assert length_reward("", "", None, meta, max_length=20, coef=0.5, truncated_penalty=1.0) == -1.25


def test_registry_and_custom_functions():
    assert {"math", "format", "dapo_overlong", "length"} <= set(REWARD_REGISTRY)
    assert resolve_reward("tests.unit.rewards.test_rewards:raising_reward") is raising_reward
    with pytest.raises(KeyError, match="unknown reward 'maths'.*registered"):
        resolve_reward("maths")
    with pytest.raises(ImportError, match="cannot import module 'no_such_mod'"):
        resolve_reward("no_such_mod:f")
    with pytest.raises(AttributeError, match="has no callable 'nope'"):
        resolve_reward("tests.unit.rewards.test_rewards:nope")
    with pytest.raises(ValueError, match="already registered"):
        register_reward("math")(raising_reward)


def test_scorer_validates_config_before_any_work():
    with pytest.raises(ValueError, match="on_error='ignore'"):
        RewardScorer(["math"], on_error="ignore")
    with pytest.raises(KeyError):
        RewardScorer(["nope"])
    with pytest.raises(ValueError, match="unknown keys"):
        RewardScorer([{"name": "math", "wieght": 2}])


def samples(*completions, reference="3"):
    return [RewardSample("p", c, reference, {"response_length": len(c)}) for c in completions]


def test_weighted_sum_of_rewards_in_worker_processes():
    specs = ["math", {"name": "format", "weight": 0.5},
             {"name": "tests.unit.rewards.test_rewards:weighted_echo", "weight": 0.1, "kwargs": {"scale": 2.0}}]
    result = score_samples(samples(r"\boxed{3}", "it is 4", "3"), specs, num_workers=2, timeout_s=30)
    assert result.components["math"] == [1.0, 0.0, 1.0]
    assert result.components["format"] == [1.0, 0.0, 0.0]
    assert result.components["tests.unit.rewards.test_rewards:weighted_echo"] == [18.0, 14.0, 2.0]
    assert result.scores == pytest.approx([1 + 0.5 + 1.8, 1.4, 1 + 0.2])
    assert result.failures == []


def test_raising_reward_stops_the_run_by_default():
    """A broken reward must not silently become 0: the default is a clear
    error naming the sample, the reward and the exception."""
    batch = samples("fine", "boom", "fine")
    with pytest.raises(RewardError) as err:
        score_samples(batch, ["tests.unit.rewards.test_rewards:raising_reward"], num_workers=1, timeout_s=30)
    msg = str(err.value)
    assert "sample 1: reward 'tests.unit.rewards.test_rewards:raising_reward' error: ZeroDivisionError: " \
           "reward exploded on purpose" in msg
    assert "on_error='zero'" in msg and "Traceback" in msg


def test_raising_reward_scores_zero_and_is_counted_when_configured():
    result = score_samples(samples("fine", "boom", "boom"), ["tests.unit.rewards.test_rewards:raising_reward"],
                           num_workers=1, timeout_s=30, on_error="zero")
    assert result.scores == [1.0, 0.0, 0.0]
    assert (result.num_errors, result.num_timeouts) == (2, 0)
    assert [f.index for f in result.failures] == [1, 2]


def test_inline_scoring_uses_the_same_policies():
    result = score_samples(samples("fine", "boom"), ["tests.unit.rewards.test_rewards:raising_reward"], num_workers=0,
                           on_error="zero")
    assert result.scores == [1.0, 0.0] and result.num_errors == 1


def test_timeout_kills_the_worker_and_the_pool_recovers():
    """An infinite loop in a reward must cost one timeout, not the run: the
    worker is killed and replaced, and later batches score normally."""
    with RewardScorer(["tests.unit.rewards.test_rewards:sleepy_reward"], num_workers=2, timeout_s=1.0,
                      on_error="zero") as scorer:
        start = time.monotonic()
        result = scorer.score(samples("ok", "hang", "ok", "ok"))
        assert time.monotonic() - start < 20
        assert result.scores == [0.5, 0.0, 0.5, 0.5]
        assert result.num_timeouts == 1 and result.failures[0].index == 1
        assert "no result within 1 s" in result.failures[0].message
        assert scorer.score(samples("ok", "ok")).scores == [0.5, 0.5]
        scorer.on_error = "raise"
        with pytest.raises(RewardError, match="sample 0: reward timeout"):
            scorer.score(samples("hang"))


def test_filter_uniform_groups_drops_groups_without_signal():
    rewards = [1, 1, 1, 0, 1, 0, 0, 0, 0, 0.5, 0.5, 0.5]
    f = filter_uniform_groups(rewards, group_size=3)
    assert (f.kept_groups, f.num_groups, f.num_dropped) == ([1], 4, 3)
    assert f.kept_samples == [3, 4, 5]
    assert filter_uniform_groups([0.0, 1e-9], 2, tol=1e-6).num_dropped == 1
    with pytest.raises(ValueError, match="do not split into groups of 4"):
        filter_uniform_groups([1, 2, 3], 4)
