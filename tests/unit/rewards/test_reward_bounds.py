"""Rewards must be finite and within REWARD_BOUND (issue 38 finding 12): a reward of 1e300
became inf in the trainer's float32 batch and crashed the step; one of 1e20 zeroed its
group's advantages. Scored inline (num_workers=0): the bound is checked where the value is
read, the same code in a worker. The reward functions are module-level so that a worker
could import them by name."""
from __future__ import annotations

import pytest

from grpo_mega.rewards import REWARD_BOUND, RewardError, RewardSample, RewardScorer, StepScores

HUGE = "tests.unit.rewards.test_reward_bounds:huge_reward"
STEPS = "tests.unit.rewards.test_reward_bounds:huge_step_reward"


def huge_reward(prompt, completion, reference, metadata, value=1e300):
    """Scores the completion "big" with ``value``, anything else 1."""
    return value if completion == "big" else 1.0


def huge_step_reward(prompt, completion, reference, metadata):
    return StepScores([1.0, 1e300 if completion == "big" else 0.0], [1, len(completion)])


def opposed_steps_reward(prompt, completion, reference, metadata):
    """Two steps at +-REWARD_BOUND: a mean of 0, each step at the bound."""
    return StepScores([REWARD_BOUND, -REWARD_BOUND], [1, len(completion)])


def _samples(n: int, big: int) -> list[RewardSample]:
    return [RewardSample("p", "big" if i == big else "ok") for i in range(n)]


@pytest.mark.parametrize("value", [1e300, 1e20, -2e6])
def test_a_reward_beyond_the_bound_stops_naming_prompt_sample_and_function(value):
    """Guards against a finite but huge reward reaching the advantages: 1e300 crashed the
    step (inf in float32), 1e20 silently zeroed its group. The error names the prompt and
    sample index of the batch (groups of rollout.n) and the reward function."""
    assert REWARD_BOUND == 1e6
    with RewardScorer([{"name": HUGE, "kwargs": {"value": value}}], num_workers=0, group_size=4) as scorer:
        with pytest.raises(RewardError) as err:
            scorer.score(_samples(8, big=6))
    msg = str(err.value)
    assert "prompt 1 sample 2" in msg and f"reward {HUGE!r}" in msg and "1e+06" in msg, msg
    with RewardScorer([{"name": HUGE, "kwargs": {"value": REWARD_BOUND}}], num_workers=0) as scorer:
        assert scorer.score(_samples(2, big=0)).scores == [REWARD_BOUND, 1.0]


def test_bound_applies_to_step_scores_and_the_weighted_total():
    """Guards against the bound being checked on plain floats only: a step score of 1e300
    (process supervision), or terms within the bound whose weights push the total (or a
    step's total) past it."""
    with RewardScorer([STEPS], num_workers=0, group_size=2) as scorer:
        with pytest.raises(RewardError, match=rf"prompt 0 sample 1 .*reward {STEPS!r}"):
            scorer.score(_samples(2, big=1))
    spec = {"name": HUGE, "weight": 10.0, "kwargs": {"value": REWARD_BOUND}}
    with RewardScorer([spec], num_workers=0, on_error="zero") as scorer:
        result = scorer.score(_samples(3, big=2))
    assert result.scores == [10.0, 10.0, 0.0] and len(result.failures) == 1
    assert "weighted total" in result.failures[0].message and "--reward.weights" in result.failures[0].message
    # step scores: a mean of 0 within the bound, but weighted steps of +-2e6 past it
    steps = {"name": "tests.unit.rewards.test_reward_bounds:opposed_steps_reward", "weight": 2.0}
    with RewardScorer([steps], num_workers=0, on_error="zero") as scorer:
        assert "2e+06" in scorer.score(_samples(1, big=-1)).failures[0].message
