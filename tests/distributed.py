"""Run a function on N real torch.distributed ranks (gloo, one thread each).

Ranks are forked from a fork server that imported torch, megatron-core and our model code
once per test process (``PRELOAD``): a rank then starts without re-importing them, about
4.5 CPU-s less each than a spawned one, on the suite's ~100 ranks. Each rank is still a
fresh process with the imports' state (the server runs no test code) and the test
process's current environment and directory (sent with every launch). A launch still
costs gloo's rendezvous and whatever ``fn`` builds: group many checks into one function.

    results = run_ranks(world_size, fn, *args)   # fn(rank, world_size, *args)

``backend="nccl"`` for GPU tests (megatron's CUDA-only collectives need it).

Every rank's return value comes back in rank order; an exception on any rank
is re-raised here with that rank's traceback, and a rank that hangs is killed
after ``timeout`` seconds.
"""
from __future__ import annotations

import atexit
import io
import os
import traceback
from datetime import timedelta

import torch
import torch.multiprocessing as mp

from grpo_mega.distributed.state import free_port


PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron.core.parallel_state",
           "megatron.core.tensor_parallel", "megatron.core.models.gpt", "grpo_mega.distributed.state",
           "grpo_mega.models", "grpo_mega.runtime.lifeline", "tests.distributed"]
"""What the fork server imports before it forks any rank: what nearly every rank function
imports. None of it starts a thread (checked: one thread after the imports), so forking
from it is safe; vLLM is left out (the ranks that run an engine spawn fresh)."""

RANK_CPU_S = [0.0]
"""CPU seconds of the ranks launched from this process (each rank reports its own): they
are the fork server's children, so ``RUSAGE_CHILDREN`` here never counts them
(tests/conftest.py adds them to a test's figure under GRPO_MEGA_TEST_CPU)."""


def _context(fresh: bool):
    if fresh:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def stop_fork_server() -> None:
    """Stop this process's fork server and wait for it (at the end of a test session), so
    that no server outlives pytest and its CPU is counted by whoever waits for pytest."""
    from multiprocessing import forkserver

    stop = getattr(forkserver._forkserver, "_stop", None)  # CPython's own, since 3.8
    if stop is not None:
        stop()


def process_cpu_s() -> float:
    """This process's CPU seconds, its waited-for children included."""
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _worker(rank, world_size, port, fn, args, queue, backend="gloo", env=None, cwd=None, from_server=False):
    # The fork server's environment and directory are those of the first launch: a test
    # that set a variable or changed directory since expects its own, as a spawn gave it.
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1",
    )
    # --- strict devices: NCCL's device rule on these gloo ranks (grpo_mega.distributed.strict_devices)
    os.environ.setdefault("GRPO_MEGA_STRICT_DEVICES", "1")
    # --- end strict devices
    import torch
    import torch.distributed as dist

    from grpo_mega.runtime import lifeline

    lifeline.watch_parent("test process", label=f"test rank {rank}")  # no orphan outlives pytest
    torch.set_num_threads(1)
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=300))
        # --- strict devices (also for ranks that never call init_parallel)
        from grpo_mega.distributed import strict_devices
        strict_devices.enable_from_env()
        # --- end strict devices
        out = fn(rank, world_size, *args)
        # Sent as bytes, not as tensors: torch's queue shares a tensor by a file descriptor
        # that the parent fetches from this process, which may have exited by then
        # (FileNotFoundError in resource_sharer, seen on a loaded 2-core machine).
        buf = io.BytesIO()
        torch.save(out, buf)
        queue.put((rank, True, buf.getvalue(), process_cpu_s()))
    except BaseException:  # noqa: BLE001 - reported to the parent verbatim
        queue.put((rank, False, traceback.format_exc(), process_cpu_s()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        # A fork server's child ends in os._exit, which skips the atexit handlers a spawned
        # rank runs at its exit: run them here (a spawned rank keeps its normal exit).
        if from_server:
            atexit._run_exitfuncs()


PORT_TAKEN = "EADDRINUSE"
"""Rank 0's store could not listen: another process took the free port between
``free_port`` and the bind (two pytest-xdist workers launch ranks side by side)."""


def run_ranks(world_size: int, fn, *args, timeout: float = 600, backend: str = "gloo",
              fresh: bool = False):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; returns their
    results in rank order. A port taken before rank 0 could bind it is retried on a new port
    (up to 3 tries; nothing has run by then). ``fresh``: spawn the ranks with nothing
    imported: for code that must run before megatron is imported (``tests/te_stub``), and
    for ranks that run a vLLM engine, whose C++ side unlinks its shared-memory segments
    only in an exit that runs static destructors (a fork server's child ends in
    ``os._exit``; the session's leak check fails on a segment left behind)."""
    for attempt in range(3):
        results, errors, port_taken = _launch(world_size, fn, args, timeout, backend, fresh)
        if not port_taken:
            break
        print(f"[run_ranks] port taken before rank 0 bound it (try {attempt + 1} of 3); relaunching")
    if errors:
        raise AssertionError("distributed run failed:\n" + "\n".join(errors))
    if len(results) != world_size:
        missing = sorted(set(range(world_size)) - set(results))
        raise AssertionError(f"ranks {missing} produced no result (hung or crashed; timeout {timeout}s)")
    return [results[r] for r in range(world_size)]


def _launch(world_size: int, fn, args, timeout: float, backend: str,
            fresh: bool = False) -> tuple[dict, list[str], bool]:
    """One launch: (results by rank, error reports, whether rank 0 found its port taken, in
    which case the other ranks are killed at once instead of waiting out the timeout)."""
    import time

    ctx = _context(fresh)
    queue = ctx.SimpleQueue()
    port = free_port()
    env, cwd = dict(os.environ), os.getcwd()
    procs = [ctx.Process(target=_worker,
                         args=(r, world_size, port, fn, args, queue, backend, env, cwd, not fresh))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors, port_taken = {}, [], False
    deadline = time.time() + timeout
    while len(results) + len(errors) < world_size:
        if time.time() > deadline:
            break
        if queue.empty():
            if not any(p.is_alive() for p in procs) and queue.empty():
                break
            time.sleep(0.05)
            continue
        rank, ok, payload, cpu_s = queue.get()
        if not fresh:  # a spawned rank is our child: RUSAGE_CHILDREN counts it once we join it
            RANK_CPU_S[0] += cpu_s
        if ok:  # our own ranks' results (weights_only=False: they hold configs and the like)
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        else:
            errors.append(f"--- rank {rank} ---\n{payload}")
            if rank == 0 and PORT_TAKEN in payload and "init_process_group" in payload:
                port_taken = True
                break
    for p in procs:
        if port_taken:
            p.kill()
        # A rank that sent its result may still be shutting down a vLLM engine (several
        # seconds on a loaded machine): killed, it leaves the engine's segments behind.
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    return results, errors, port_taken


def world2_layouts(rows: int = 6):
    """Inside a 2-rank launch: TP=2, PP=2 and DP=2 one after another, yielding ``(name, ps,
    this rank's row slice)`` (each DP rank half of ``rows``), the model-parallel state
    rebuilt between them; the tests that compare a layout with TP=1 share it."""
    from megatron.core import parallel_state as mpu

    from grpo_mega.distributed.state import init_parallel

    for name, (tp, pp) in (("tp2", (2, 1)), ("pp2", (1, 2)), ("dp2", (1, 1))):
        mpu.destroy_model_parallel()
        ps = init_parallel(tp, pp, seed=11)
        half = rows // 2
        yield name, ps, slice(half * ps.dp_rank, half * ps.dp_rank + half) if ps.dp > 1 else slice(0, rows)
