"""One writer per run directory: a lock that names its holder, and that a dead job gives up.

Two jobs writing one run directory corrupt it quietly: after a launcher was killed alone,
its ranks went on saving checkpoints while a restart of the same command loaded from the
same directory, and its two ranks resumed from different half-written steps.

Global rank 0 takes an exclusive ``flock`` on ``<dir>/.grpo-mega.lock`` for the life of the
job, in the run directory and in the checkpoint directory itself (``lock_run``): two jobs
with different run directories shared one checkpoint directory when one kept it inside its
run directory and the other pointed ``--checkpoint.dir`` at it. The lock and writes who holds it (host, pid, start time, command) into the file. The kernel
drops a ``flock`` when its holder dies however it dies, so a lock left by a killed job is
free and simply taken over (its old contents are reported). A second live job gets a
``RunDirectoryLocked`` error naming the holder. On a shared filesystem the lock is as good
as its ``flock`` (NFSv4 and Lustre with ``flock`` mounts honour it across nodes).

    lock = RunLock.acquire(run_dir)   # raises RunDirectoryLocked
    ...
    lock.release()
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

LOCK_NAME = ".grpo-mega.lock"


class RunDirectoryLocked(RuntimeError):
    """Another live job holds the run directory."""


def _describe(holder: dict) -> str:
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if started else "?"
    return f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, started {when}"


def read_holder(directory: Path) -> Optional[dict]:
    """What the lock file says of its (last) holder, or None."""
    try:
        return json.loads((Path(directory) / LOCK_NAME).read_text() or "null")
    except (OSError, ValueError):
        return None


@dataclass
class RunLock:
    directory: Path
    fd: int
    previous: Optional[dict]
    """The holder recorded by a job that died with the lock (taken over), else None."""

    @classmethod
    def acquire(cls, directory: str | os.PathLike, what: str = "run directory") -> "RunLock":
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = read_holder(directory) or {}
            raise RunDirectoryLocked(
                f"{what} {directory.resolve()} is in use by another job ({_describe(holder)}); "
                "stop that job, or give this one another --logging.run_dir (or --checkpoint.dir)"
            ) from None
        previous = read_holder(directory)
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
              "command": " ".join(sys.argv)[:2000]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        os.fsync(fd)
        return cls(directory, fd, previous or None)

    def release(self) -> None:
        if self.fd >= 0:
            os.ftruncate(self.fd, 0)  # a clean exit leaves no holder behind to "take over"
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1

    def taken_over(self) -> Optional[str]:
        """A line about the dead job whose lock this one took over, or None."""
        return None if not self.previous else f"took over the lock of a job that is gone ({_describe(self.previous)})"


def lock_run(run_dir: str | os.PathLike, ckpt_dir: str | os.PathLike) -> list[RunLock]:
    """Lock the run directory and the checkpoint directory (once when they are the same
    directory; a second ``flock`` of one file from this process would refuse itself).
    Raises ``RunDirectoryLocked`` naming the directory and its holder, holding nothing."""
    dirs = {Path(run_dir).resolve(): "run directory"}
    dirs.setdefault(Path(ckpt_dir).resolve(), "checkpoint directory")
    locks: list[RunLock] = []
    try:
        for d, what in dirs.items():
            locks.append(RunLock.acquire(d, what))
    except BaseException:
        for lock in locks:
            lock.release()
        raise
    return locks
