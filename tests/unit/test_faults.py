"""The fault-injection hook (grpo_mega/runtime/faults.py) and the one-rank-fails-all-raise helper."""
from __future__ import annotations

import pytest

from grpo_mega.runtime import faults
from grpo_mega.runtime.faults import Fault, FaultInjected, fault_point, parse
from tests.distributed import run_ranks


def test_fault_spec_parses_every_field_and_rejects_bad_ones():
    """Guards against a spec silently meaning something else (a rank read as a step, a
    count dropped), and against a typo'd point that would inject nothing: a test that
    sets it would then pass for the wrong reason."""
    assert parse("checkpoint.save") == Fault("checkpoint.save")
    assert parse("bridge.sync:kill:2@1#5") == Fault("bridge.sync", "kill", 2, 1, 5, False)
    assert parse("update:nan#3+") == Fault("update", "nan", 1, None, 3, True)
    for spec, why in [("checkpoint.sav", "unknown point"), ("update:explode", "unknown action"),
                      ("rollout.generate:nan", "only the update point"), ("step@x", "not an integer")]:
        with pytest.raises(ValueError, match=why) as e:
            parse(spec)
        assert "GRPO_MEGA_FAULT" in str(e.value)


def test_fault_point_fires_only_at_its_point_rank_step_and_count(monkeypatch):
    """Guards against a fault that fires at the wrong place (another point, rank, step or
    bucket), which would test a different failure than the one named, and against a
    ``#N+`` that stops after step N (three NaN steps in a row need it to go on)."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(faults, "_FAULT", parse("bridge.sync:raise:2@1#3"))
    faults.set_step(3)
    assert fault_point("bridge.sync", k=1) is False
    assert fault_point("checkpoint.save", k=2) is False
    with pytest.raises(FaultInjected, match=r"bridge.sync \(rank 1, step 3, count 2\)"):
        fault_point("bridge.sync", k=2)
    faults.set_step(4)
    assert fault_point("bridge.sync", k=2) is False
    monkeypatch.setenv("RANK", "0")
    faults.set_step(3)
    assert fault_point("bridge.sync", k=2) is False

    monkeypatch.setattr(faults, "_FAULT", parse("update:nan#3+"))
    assert [(faults.set_step(s), fault_point("update"))[1] for s in (2, 3, 4, 9)] == [False, True, True, True]
    monkeypatch.setattr(faults, "_FAULT", None)
    assert fault_point("update") is False


def _ranks_see_the_leaders_error(rank, world):
    import torch.distributed as dist

    from grpo_mega.distributed.errors import RemoteError, run_on_src

    group = dist.new_group([0, 1])
    ok = run_on_src(lambda: ([rank, 0.5], 3), 1, group, "reward scoring")

    def boom():
        raise ValueError("reward function 'bad' crashed")
    try:
        run_on_src(boom, 1, group, "reward scoring")
        err = None
    except RemoteError as e:
        err = str(e)
    return ok, err


def test_fault_on_the_leader_raises_the_same_clear_error_on_every_rank():
    """Guards against the other ranks of a replica waiting in the broadcast until the
    collective timeout (or torchrun's teardown) when the leader's reward scoring fails,
    and against them reporting a timeout instead of the cause: every rank must raise the
    leader's error, naming the leader's rank, and a success must still deliver the result."""
    results = run_ranks(2, _ranks_see_the_leaders_error, timeout=120)
    for ok, err in results:
        assert ok == ([1, 0.5], 3)
        assert err == "reward scoring failed on rank 1: ValueError: reward function 'bad' crashed"
