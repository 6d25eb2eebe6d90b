"""Restarting after a kill: ranks die with their launcher, one job per run directory, and
every rank resumes from the checkpoint rank 0 chose."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from grpo_mega.checkpoint.run_lock import LOCK_NAME, RunDirectoryLocked, RunLock
from tests import REPO

PY = sys.executable
ENV = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")


def _gone(pid: int, within: float) -> bool:
    deadline = time.time() + within
    while time.time() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.1)
    return False


def test_kill_orphaned_rank_stops_with_its_children_when_its_launcher_dies(tmp_path):
    """Guards against an orphaned rank: torchrun starts ranks in their own sessions, so a
    SIGKILL of the agent alone left them training and writing checkpoints. A process that
    called ``watch_parent`` must exit within seconds of its parent's death, and take its
    own child (a reward worker, say) with it."""
    script = tmp_path / "tree.py"
    script.write_text(textwrap.dedent("""
        import subprocess, sys, time
        if sys.argv[1] == "launcher":
            subprocess.Popen([sys.executable, __file__, "rank"], start_new_session=True)
            time.sleep(300)
        else:
            from grpo_mega.runtime import lifeline
            assert lifeline.watch_parent("launcher", interval=0.2, label="rank 0")
            kid = subprocess.Popen(["sleep", "300"])
            print("ready", __import__("os").getpid(), kid.pid, flush=True)
            time.sleep(300)
    """))
    launcher = subprocess.Popen([PY, str(script), "launcher"], env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        word, rank, kid = launcher.stdout.readline().split()
        assert word == "ready"
        rank, kid = int(rank), int(kid)
        assert psutil.pid_exists(rank) and psutil.pid_exists(kid)
        launcher.kill()
        launcher.wait()
        assert _gone(rank, 5.0), "the rank outlived its launcher"
        assert _gone(kid, 5.0), "the rank's child outlived it"
    finally:
        launcher.kill()
        for pid in (locals().get("rank"), locals().get("kid")):
            if isinstance(pid, int) and psutil.pid_exists(pid):
                os.kill(pid, signal.SIGKILL)


def test_restart_second_writer_is_refused_naming_the_holder_and_a_dead_holders_lock_taken_over(tmp_path):
    """Guards against two writers in one run directory: a second job must be refused with
    the first one's host and pid, while a lock left by a SIGKILLed job must not block the
    restart (it is taken over, and says whose it was), and a clean exit leaves nothing to
    take over."""
    holder = subprocess.Popen(
        [PY, "-c", "import sys,time; from grpo_mega.checkpoint.run_lock import RunLock; "
         f"RunLock.acquire({str(tmp_path)!r}); print('locked', flush=True); time.sleep(300)"],
        env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirectoryLocked, match=rf"in use by another job \(host \S+, pid {holder.pid}, "):
            RunLock.acquire(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    lock = RunLock.acquire(tmp_path)  # the holder was SIGKILLed: its flock is gone
    assert lock.taken_over() and f"pid {holder.pid}" in lock.taken_over()
    with pytest.raises(RunDirectoryLocked, match=f"pid {os.getpid()}"):
        RunLock.acquire(tmp_path)  # one writer even within one process
    lock.release()
    again = RunLock.acquire(tmp_path)
    assert again.taken_over() is None and (tmp_path / LOCK_NAME).exists()
    again.release()


def _claim_rank(rank, world, root):
    from grpo_mega.checkpoint import trainer_state
    from grpo_mega.trainer import trainer

    # Each rank "sees" a different latest checkpoint, as two ranks did while another job
    # rotated the directory under them.
    trainer_state_resume = trainer_state.resume_checkpoint
    trainer_state.resume_checkpoint = lambda d, mode: Path(d) / f"step_0000000{4 + 2 * rank}"
    try:
        cfg = SimpleNamespace(logging=SimpleNamespace(run_dir=root),
                              checkpoint=SimpleNamespace(resume="auto"))
        ps = SimpleNamespace(rank=rank, world_size=world)
        locks, found = trainer._claim_run(cfg, ps, Path(root) / "checkpoints", lambda m: None)
        held = [str(lk.directory) for lk in locks]
        for lk in locks:
            lk.release()
        return str(found), held
    finally:
        trainer_state.resume_checkpoint = trainer_state_resume


def test_restart_every_rank_resumes_the_checkpoint_rank_0_chose(tmp_path):
    """Guards against ranks resuming different checkpoints (each read ``latest`` itself, and
    a concurrent writer rotated it between their reads): rank 1 must take rank 0's choice,
    and only rank 0 holds the locks (the run directory's and the checkpoint directory's)."""
    from tests.distributed import run_ranks

    (r0, held0), (r1, held1) = run_ranks(2, _claim_rank, str(tmp_path), timeout=120)
    assert r0 == r1 == str(tmp_path / "checkpoints" / "step_00000004")
    assert held0 == [str(tmp_path.resolve()), str((tmp_path / "checkpoints").resolve())] and held1 == []


def test_kill_child_of_a_rank_killed_before_it_could_watch_stops_at_once(tmp_path):
    """Guards against an orphaned child of a rank: a rank SIGKILLed while its spawn child
    (a reward worker, megatron's checkpoint writer) was still importing left the child
    re-parented to init, where a watcher that reads ``getppid()`` at start sees nothing to
    outlive; it lived for the rest of the machine's day. A child told its parent's pid must
    stop at once when that parent is already gone, and keep running while it is alive."""
    from grpo_mega.runtime import lifeline

    dead = subprocess.Popen([PY, "-c", "pass"])
    dead.wait()
    code = ("import time; from grpo_mega.runtime import lifeline; "
            "lifeline.watch_spawning_parent('test child'); print('running', flush=True); time.sleep(30)")
    orphan = subprocess.run([PY, "-c", code], env=dict(ENV, **{lifeline.PARENT_ENV: str(dead.pid)}),
                            capture_output=True, text=True, timeout=60)
    assert orphan.returncode == lifeline.EXIT_CODE and "running" not in orphan.stdout, orphan
    assert f"(pid {dead.pid}) is gone" in orphan.stderr, orphan.stderr
    alive = subprocess.Popen([PY, "-c", code], env=dict(ENV, **{lifeline.PARENT_ENV: str(os.getpid())}),
                             stdout=subprocess.PIPE, text=True)
    try:
        assert alive.stdout.readline().strip() == "running"
    finally:
        alive.kill()
        alive.wait()
