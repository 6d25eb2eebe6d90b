"""Starting engine servers and shaking hands with them (the controller's side of start-up).

:func:`server_command` is the command line of engine k (what a cluster launcher runs on
another node, with ``AUTHKEY_ENV`` set to the controller's key); :func:`spawn` runs it here
as a child process with its device (GPU: ``CUDA_VISIBLE_DEVICES``) or core set (CPU:
``--cores``); :func:`accept` collects the servers' hellos, with a deadline and an eye on the
spawned processes, so a server that dies while importing fails the start at once.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Listener
from typing import Sequence

from grpo_mega.rollout.remote import wire

__all__ = ["server_command", "spawn", "accept", "RemoteEngineError"]


class RemoteEngineError(RuntimeError):
    """An engine server died, hung or failed; the message names the engine and what it was
    doing."""


def server_command(address: tuple[str, int], index: int, *, cores: Sequence[int] = (),
                   parent_pid: int | None = None, python: str = sys.executable) -> list[str]:
    """The command line of engine ``index`` connecting back to the listener at ``address``."""
    cmd = [python, "-m", "grpo_mega.rollout.remote.server", "--controller",
           f"{address[0]}:{address[1]}", "--index", str(index)]
    if cores:
        cmd += ["--cores", ",".join(str(c) for c in cores)]
    if parent_pid:
        cmd += ["--parent-pid", str(parent_pid)]
    return cmd


def spawn(address: tuple[str, int], authkey: str, index: int, *, cores: Sequence[int] = (),
          devices: Sequence[int] = ()) -> subprocess.Popen:
    """Start engine ``index`` as a child of this process (it stops when we die: lifeline).
    ``devices``: the CUDA ids it may see (GPU); ``cores``: the CPU cores it runs on."""
    env = dict(os.environ)
    env[wire.AUTHKEY_ENV] = authkey
    if devices:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
    # Whatever this process set for its own engines must not leak into the server's vLLM:
    # RolloutEngine sets what it needs.
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    return subprocess.Popen(server_command(address, index, cores=cores, parent_pid=os.getpid()),
                            env=env, stdin=subprocess.DEVNULL)


def accept(listener: Listener, count: int, procs: dict[int, subprocess.Popen], timeout_s: float
           ) -> dict[int, tuple[object, int]]:
    """{index: (connection, pid)} of ``count`` servers, from their hellos. Raises
    RemoteEngineError when a spawned server exits first or the deadline passes (the listener
    is then closed, which also ends the accepting thread)."""
    got: dict[int, tuple[object, int]] = {}
    failure: list[str] = []

    def run() -> None:
        try:
            while len(got) < count:
                try:
                    conn = listener.accept()
                except AuthenticationError:  # a peer without the key: ignore it
                    continue
                if not conn.poll(timeout_s):
                    conn.close()
                    continue
                hello = wire.recv(conn)
                k = int(hello.get("index", -1))
                if hello["op"] != "hello" or not 0 <= k < count or k in got:
                    failure.append(f"unexpected hello {hello}")
                    conn.close()
                    continue
                got[k] = (conn, int(hello["pid"]))
        except (OSError, EOFError, ValueError) as e:  # listener closed, or a bad peer
            if len(got) < count:
                failure.append(f"{type(e).__name__}: {e}")

    t = threading.Thread(target=run, name="grpo-remote-accept", daemon=True)
    t.start()
    deadline = time.monotonic() + timeout_s
    while t.is_alive():
        t.join(0.2)
        dead = {k: p.poll() for k, p in procs.items() if k not in got and p.poll() is not None}
        if dead or time.monotonic() > deadline:
            listener.close()
            for conn, _ in got.values():
                conn.close()
            if dead:
                k, rc = next(iter(dead.items()))
                raise RemoteEngineError(f"engine {k} (pid {procs[k].pid}) died while starting: "
                                        f"exit code {rc} (see its output above)")
            missing = sorted(set(range(count)) - set(got))
            raise RemoteEngineError(f"engines {missing} did not connect within {timeout_s:.0f} s "
                                    f"({'; '.join(failure) or 'no hello'})")
    if len(got) < count:
        raise RemoteEngineError(f"engine start failed: {'; '.join(failure)}")
    return got
