"""Processes that die with their launcher: a rank whose torchrun agent is gone stops.

torchrun starts each rank in its own session, so a SIGKILL of torchrun's process group
(what a user's Ctrl-\\, a wrapper script or a careless ``kill -9 -PGID`` does) leaves the
ranks running: they went on training and writing checkpoints into the run directory while
a restart of the same command started beside them. A reward worker whose rank was killed
by the OOM killer likewise lived on.

``watch_parent`` starts a daemon thread that polls ``os.getppid()``: when the parent is
gone the process is re-parented (to init or a subreaper), the pid changes, and within
``interval`` seconds the watcher kills this process's own descendants and exits with
``EXIT_CODE``. Polling is used rather than ``prctl(PR_SET_PDEATHSIG)``: that signal fires
when the parent *thread* that forked us exits, which a launcher that spawns from a worker
thread would trigger while alive, and it is Linux-only.

This module imports nothing of ours, so every part of the package may use it.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Optional

EXIT_CODE = 75
"""Exit status of a process stopped because its parent died (EX_TEMPFAIL: retry later)."""
PARENT_ENV = "GRPO_MEGA_PARENT_PID"
"""The pid a watched process's children must outlive no longer than: set by every watched
process (and by the trainer) for the children it starts, which inherit it."""

_started: Optional[int] = None


def _kill_descendants() -> None:
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil is a dependency; without it children may linger
        return
    try:
        kids = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    for k in kids:
        try:
            k.kill()
        except psutil.Error:
            pass


def watch_parent(what: str = "launcher", interval: float = 1.0, *, label: str = "",
                 expected_parent: Optional[int] = None) -> bool:
    """Exit this process (and kill its descendants) within ``interval`` seconds of its parent's
    death. ``what`` names the parent in the message. ``expected_parent``: the pid that started
    us, when known; if it is already gone (a rank SIGKILLed while its child was still
    importing) we stop at once instead of watching init. Returns False, and watches nothing,
    when the parent is init (nothing to outlive) or a watcher runs in this process already."""
    global _started
    parent = os.getppid()
    who = label or f"pid {os.getpid()}"
    if expected_parent is not None and parent != expected_parent:
        print(f"[grpo] {who}: its {what} (pid {expected_parent}) is gone; stopping", file=sys.stderr,
              flush=True)
        _kill_descendants()
        os._exit(EXIT_CODE)
    if parent == 1 or _started == os.getpid():
        return False
    _started = os.getpid()
    os.environ[PARENT_ENV] = str(os.getpid())  # what our own children will watch

    def loop() -> None:
        while True:
            time.sleep(interval)
            if os.getppid() != parent:
                print(f"[grpo] {who}: its {what} (pid {parent}) is gone; stopping this process "
                      "and its children", file=sys.stderr, flush=True)
                _kill_descendants()
                os._exit(EXIT_CODE)

    threading.Thread(target=loop, name="grpo-parent-watch", daemon=True).start()
    return True


def watch_spawning_parent(label: str = "child process") -> bool:
    """In a ``multiprocessing`` spawn child of a watched process (a reward worker, megatron's
    checkpoint writer, a child vLLM engine): watch the pid the parent recorded in
    ``PARENT_ENV``. Such children re-import the parent's main module as ``__mp_main__``, which
    is where ``grpo_mega.train`` calls this; a child of a SIGKILLed rank otherwise lived on."""
    pid = os.environ.get(PARENT_ENV, "")
    if not pid.isdigit():
        return False
    return watch_parent("parent process", label=label, expected_parent=int(pid))


def launched_by_launcher() -> bool:
    """Whether torchrun (or a launcher that sets its variables) started this process."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "TORCHELASTIC_RESTART_COUNT" in os.environ


def kill_tree_now(pid: int, sig: int = signal.SIGKILL) -> list[int]:
    """Freeze ``pid`` and every descendant, then signal them all at once (what a cgroup kill
    or a preemption does: nobody gets to react to a sibling's death). Returns the pids."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        return []
    for p in procs:
        try:
            p.send_signal(signal.SIGSTOP)
        except psutil.Error:
            pass
    # A process forked between the listing and the stop escapes the first pass.
    try:
        procs += [c for c in root.children(recursive=True) if c not in procs]
    except psutil.Error:
        pass
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.Error:
            pass
    return [p.pid for p in procs]
