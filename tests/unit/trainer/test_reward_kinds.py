"""The loop's check that rewards match ``algorithm.advantage`` (outcome: floats; process:
StepScores), on real scorer results."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from grpo_mega.rewards import RewardSample, RewardScorer, StepScores
from grpo_mega.trainer.stages import _reward_values

STEPS = "tests.unit.rewards.test_steps:digit_steps"
PLAIN = "tests.unit.rewards.test_steps:plain"


def _values(advantage, reward, completions=("9a",)):
    with RewardScorer([reward], num_workers=0) as scorer:
        result = scorer.score([RewardSample("p", c) for c in completions])
        t = SimpleNamespace(cfg=SimpleNamespace(algorithm=SimpleNamespace(advantage=advantage)), scorer=scorer)
        return _reward_values(t, result)


def test_reward_kind_must_match_the_advantage_estimator():
    """Guards against a process run silently training on plain floats (no step advantages
    at all) and an outcome run dropping a reward's steps: the first such sample stops the
    run, naming the reward functions and the flag to change."""
    assert _values("process", STEPS) == [StepScores([1.0, 0.0], [1, 2])]
    assert _values("outcome", PLAIN) == [1.0]
    with pytest.raises(ValueError, match=r"plain.*--algorithm.advantage=outcome"):
        _values("process", PLAIN)
    with pytest.raises(ValueError, match=r"digit_steps.*--algorithm.advantage=process"):
        _values("outcome", STEPS)
