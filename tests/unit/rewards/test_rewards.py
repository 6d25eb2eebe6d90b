"""Tests for grpo_mega.rewards.registry and grpo_mega.rewards.scorer: name
resolution, and the sandboxed scorer's weighting, error and timeout policies.

The custom reward functions below are imported by name in spawned worker
processes ("tests.unit.rewards.test_rewards:..."), so they must stay at module
level, in a module of this name.
"""
from __future__ import annotations

import time

import pytest

from grpo_mega.rewards import (
    REWARD_REGISTRY, RewardError, RewardSample, RewardScorer, register_reward, resolve_reward, score_samples,
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


def test_registry_and_custom_functions():
    """Guards against built-ins missing from the registry, module:function paths
    failing with an unclear error, and a second function silently taking a name."""
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
    """Guards against a bad policy, name or spec key surfacing only after a rollout."""
    with pytest.raises(ValueError, match="on_error='ignore'"):
        RewardScorer(["math"], on_error="ignore")
    with pytest.raises(KeyError):
        RewardScorer(["nope"])
    with pytest.raises(ValueError, match="unknown keys"):
        RewardScorer([{"name": "math", "wieght": 2}])


def samples(*completions, reference="3"):
    return [RewardSample("p", c, reference, {"response_length": len(c)}) for c in completions]


def test_weighted_sum_of_rewards_in_worker_processes():
    """Guards against weights applied to the wrong term, kwargs not reaching the
    function, and registered or module:function names not resolving in spawned workers."""
    specs = ["math", {"name": "format", "weight": 0.5},
             {"name": "tests.unit.rewards.test_rewards:weighted_echo", "weight": 0.1, "kwargs": {"scale": 2.0}}]
    result = score_samples(samples(r"\boxed{3}", "it is 4", "3"), specs, num_workers=2, timeout_s=30)
    assert result.components["math"] == [1.0, 0.0, 1.0]
    assert result.components["format"] == [1.0, 0.0, 0.0]
    assert result.components["tests.unit.rewards.test_rewards:weighted_echo"] == [18.0, 14.0, 2.0]
    assert result.scores == pytest.approx([1 + 0.5 + 1.8, 1.4, 1 + 0.2])
    assert result.failures == []


def torch_loaded_reward(prompt, completion, reference, metadata, **kwargs):
    """1.0 when the worker process running it has imported torch."""
    import sys

    return float("torch" in sys.modules)


def test_trainer_reward_workers_start_without_torch(monkeypatch):
    """Guards against reward workers of ``python -m grpo_mega.train`` loading torch (~1.5
    CPU-s per worker, two per rank, every run): through the trainer's main module, which a
    spawned child re-imports as ``__mp_main__``, or through the demo's reward module."""
    import importlib.util
    import sys

    monkeypatch.setattr(sys.modules["__main__"], "__spec__", importlib.util.find_spec("grpo_mega.train"))
    probe = "tests.unit.rewards.test_rewards:torch_loaded_reward"
    result = score_samples(samples("3", "4"), ["grpo_mega.demo.assets:exact_match_reward", probe],
                           num_workers=1, timeout_s=60)
    assert result.components["grpo_mega.demo.assets:exact_match_reward"] == [1.0, 0.0]
    assert result.components[probe] == [0.0, 0.0], "a reward worker imported torch"


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
    """Guards against on_error=zero losing count of failures or zeroing the wrong sample."""
    result = score_samples(samples("fine", "boom", "boom"), ["tests.unit.rewards.test_rewards:raising_reward"],
                           num_workers=1, timeout_s=30, on_error="zero")
    assert result.scores == [1.0, 0.0, 0.0]
    assert (result.num_errors, result.num_timeouts) == (2, 0)
    assert [f.index for f in result.failures] == [1, 2]


def test_inline_scoring_uses_the_same_policies():
    """Guards against num_workers=0 (debugging) applying a different error policy."""
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


def test_overlong_penalty_gets_its_kwargs_from_config_through_the_worker_pool():
    """Guards against reward.kwargs not reaching the function: the overlong penalty needs
    max_length/buffer and, with none passed, raised TypeError on every sample. Config ->
    validation -> the trainer's specs -> spawned scoring workers -> DAPO eq. 13 values."""
    from grpo_mega.config import load_config
    from grpo_mega.preflight.validate import reward_specs, validate

    cfg = validate(load_config(None, ["--reward.functions=[math, dapo_overlong]", "--reward.weights=[1, 0.5]",
                                      "--reward.kwargs={dapo_overlong: {max_length: 20, buffer: 5}}"]),
                   1, check_hardware=False)
    batch = [RewardSample("p", r"\boxed{3}", "3", {"response_length": n}) for n in (0, 15, 16, 20, 21)]
    result = score_samples(batch, reward_specs(cfg), num_workers=1, timeout_s=30)
    assert result.failures == []
    assert result.components["dapo_overlong"] == [0.0, 0.0, -0.2, -1.0, -1.0]
    assert result.scores == pytest.approx([1.0, 1.0, 0.9, 0.5, 0.5])


def test_scorer_refuses_kwargs_the_function_does_not_take():
    """Guards against a scorer built outside the trainer (no config validation) turning a
    misspelt kwarg into one TypeError per sample instead of one error up front."""
    with pytest.raises(ValueError, match="reward 'math'.*unexpected keyword argument 'corect'"):
        RewardScorer([{"name": "math", "kwargs": {"corect": 2.0}}])
    with pytest.raises(ValueError, match="missing a required argument: 'buffer'"):
        RewardScorer([{"name": "dapo_overlong", "kwargs": {"max_length": 20}}])


WARMED = []


def needs_warm_up(prompt, completion, reference, metadata, **kwargs):
    if not WARMED:
        raise RuntimeError("scored before warm_up ran in this worker")
    return WARMED[0]


def _slow_warm_up(value=1.0, **_):
    time.sleep(1.5)  # longer than the sample timeout below
    WARMED.append(value)


needs_warm_up.warm_up = _slow_warm_up


def test_warm_up_runs_once_per_worker_before_samples_and_is_not_timed():
    """Guards against heavy imports (sympy for the math reward) counting against the first
    sample's timeout: a 1.5 s warm-up with a 1 s sample timeout must not time out, and
    the function's kwargs reach warm_up."""
    spec = {"name": "tests.unit.rewards.test_rewards:needs_warm_up", "kwargs": {"value": 0.25}}
    result = score_samples(samples("a", "b"), [spec], num_workers=1, timeout_s=1.0, on_error="zero")
    assert result.failures == [] and result.scores == [0.25, 0.25]
