"""Step-scored rewards (process supervision) through the scoring pool.

Reward functions here are resolved by name in spawned workers
("tests.unit.rewards.test_steps:..."), so they stay at module level."""
from __future__ import annotations

import time

import pytest

from grpo_mega.rewards import RewardError, RewardSample, RewardScorer, StepScores, score_samples

MOD = "tests.unit.rewards.test_steps"


def digit_steps(prompt, completion, reference, metadata, **kwargs):
    """Every character is a step; 1 when it is a digit."""
    return StepScores([1.0 if c.isdigit() else 0.0 for c in completion], range(1, len(completion) + 1))


def nine_steps(prompt, completion, reference, metadata, **kwargs):
    """Same steps as digit_steps; 1 when the character is '9'."""
    return StepScores([1.0 if c == "9" else 0.0 for c in completion], range(1, len(completion) + 1))


def word_steps(prompt, completion, reference, metadata, **kwargs):
    """One step per whitespace-separated word (different ends from the per-character terms)."""
    ends, pos = [], 0
    for w in completion.split(" "):
        pos += len(w)
        ends.append(pos)
        pos += 1
    return StepScores([1.0] * len(ends), ends)


def past_the_end(prompt, completion, reference, metadata, **kwargs):
    return StepScores([1.0], [len(completion) + 1])


def hanging_steps(prompt, completion, reference, metadata, **kwargs):
    while "hang" in completion:  # stuck forever: the worker must be killed
        time.sleep(0.05)
    return digit_steps(prompt, completion, reference, metadata)


def plain(prompt, completion, reference, metadata, **kwargs):
    return 1.0


def _samples(*completions):
    return [RewardSample("p", c) for c in completions]


def test_step_scores_cross_the_worker_pool_weighted_per_step():
    """Guards against step scores being flattened to a float (or lost) in the spawn pool,
    and against weights applied to the sum instead of each step: two terms with the same
    steps give weight-summed per-step scores; ``scores`` holds the weighted mean values."""
    specs = [f"{MOD}:digit_steps", {"name": f"{MOD}:nine_steps", "weight": 2.0}]
    result = score_samples(_samples("9a1", ""), specs, num_workers=1, timeout_s=30)
    assert result.steps[0] == StepScores([3.0, 0.0, 1.0], [1, 2, 3])
    assert result.steps[1] == StepScores([], [])
    assert result.scores == pytest.approx([2 / 3 + 2 * (1 / 3), 0.0])
    assert result.components[f"{MOD}:digit_steps"] == pytest.approx([2 / 3, 0.0])
    plain_result = score_samples(_samples("x"), [f"{MOD}:plain"], num_workers=0)
    assert plain_result.steps == [None]


@pytest.mark.parametrize("specs,culprit,words", [
    ([f"{MOD}:digit_steps", f"{MOD}:plain"], "plain", "returned a float"),
    ([f"{MOD}:digit_steps", f"{MOD}:word_steps"], "word_steps", "different"),
    ([f"{MOD}:past_the_end"], "past_the_end", "strictly increasing"),
])
def test_malformed_or_mixed_step_rewards_fail_naming_the_function(specs, culprit, words):
    """Guards against silently combining incompatible step layouts (a float term, other
    step ends) or ends past the completion, which would credit the wrong tokens."""
    with pytest.raises(RewardError, match=words) as e:
        score_samples(_samples("9 1"), specs, num_workers=0)
    assert culprit in str(e.value)


def test_step_reward_timeout_still_enforced():
    """Guards against the step-score path bypassing the per-sample deadline."""
    with RewardScorer([f"{MOD}:hanging_steps"], num_workers=1, timeout_s=1.0, on_error="zero") as scorer:
        result = scorer.score(_samples("hang", "7x"))
    assert result.num_timeouts == 1 and result.steps == [None, StepScores([1.0, 0.0], [1, 2])]
