"""The engine's GPU-only branches (rollout/sleep.py memory phases, the child engine's device), driven on CPU.

vLLM has no sleep mode on CPU, so the branch a GPU job takes is run here against a
recorder standing in for ``vllm.LLM`` (its ``sleep``/``wake_up`` signatures as pinned) and
for torch's CUDA cache; the real loop's order on CPU is checked in
tests/integration/test_memory_phases.py.
"""
from __future__ import annotations

import collections
import types

import pytest
import torch

from grpo_mega.rollout import sleep as S


class _Recorder:
    def __init__(self, log):
        self.log = log

    def sleep(self, level: int = 1):
        self.log.append(("sleep", level))

    def wake_up(self, tags=None):
        self.log.append(("wake_up", tuple(tags) if tags else None))


class _Engine(S.SleepPhases):
    def __init__(self, log):
        self.llm, self.on_cpu, self.holds_engine = _Recorder(log), False, True
        self.config = types.SimpleNamespace(colocate=True)
        self.calls = collections.deque()
        self.releases = self.resumes = 0
        self.memory_released, self._asleep, self._weights_stale = False, set(), False

    def _finish_update(self):
        """The host's hook (sleep.SleepPhases docstring): closes an open reload; none here."""


@pytest.fixture
def gpu_log(monkeypatch):
    log = []
    reserved = [8 << 30]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: reserved[0])

    def empty_cache():
        log.append(("empty_cache",))
        reserved[0] = 1 << 30
    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    return log


def test_gpu_ready_sleep_level_2_and_torch_cache_emptied_before_the_weights_wake(gpu_log):
    """Guards against issue 27's defects 3 and 10 and the order of deliver 6: torch's caching
    allocator still holding the update's activations when vLLM maps fresh memory for its
    weights (no ``empty_cache``: about 83 GiB at wake-up for 70B on an 80 GB card); sleep
    level 1, which offloads weights to pinned host memory that the sync then overwrites;
    the KV cache woken before the sync (its memory taken while the sync's buffers live)."""
    e = _Engine(gpu_log)
    e.release()
    assert e.memory_released
    e.wake_weights()
    e._weights_stale = False  # the sync's first load (RolloutEngine.update_weights)
    e.wake_kv_cache()
    assert gpu_log == [("sleep", 2), ("empty_cache",), ("wake_up", ("weights",)), ("wake_up", ("kv_cache",))]
    assert not e.memory_released
    assert list(e.calls) == ["release", "empty_cache", "wake_weights", "wake_kv_cache"]


def test_gpu_ready_resume_refuses_discarded_weights_that_no_sync_loaded(gpu_log):
    """Guards against sampling from garbage: after a level-2 sleep the weights' memory comes
    back uninitialised, so a plain resume() with no sync in between must fail loudly."""
    e = _Engine(gpu_log)
    e.release()
    with pytest.raises(RuntimeError, match="discarded by release"):
        e.resume()


def test_gpu_ready_child_engine_runs_on_this_ranks_gpu(monkeypatch):
    """Guards against issue 27's defect 4: ``rollout.engine_mode=child`` spawned the engine
    core without this rank's ``set_device(LOCAL_RANK)``, so vLLM's uni executor put every
    node's engines on GPU 0. The child must see only this rank's GPU, through the parent's
    own CUDA_VISIBLE_DEVICES when it has one."""
    from grpo_mega.rollout.engine import RolloutEngine, child_visible_devices

    assert child_visible_devices(None, 3) == "3"
    assert child_visible_devices("4,5,6,7", 2) == "6"
    assert child_visible_devices("GPU-a, GPU-b", 1) == "GPU-b"
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        child_visible_devices("0,1", 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    from grpo_mega.rollout.types import EngineConfig

    e = RolloutEngine.__new__(RolloutEngine)
    e.on_cpu, e.mode, e.config = False, "child", EngineConfig(model="unused")
    assert e._engine_env()["CUDA_VISIBLE_DEVICES"] == "5"
    e.mode = "external_launcher"  # vLLM takes LOCAL_RANK itself there
    assert "CUDA_VISIBLE_DEVICES" not in e._engine_env()
