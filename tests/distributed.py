"""Run a function on N real torch.distributed ranks (gloo, one thread each).

Each call spawns fresh processes, so it costs the imports (several seconds
with megatron). Group many checks into one function per launch.

    results = run_ranks(world_size, fn, *args)   # fn(rank, world_size, *args)

``backend="nccl"`` for GPU tests (megatron's CUDA-only collectives need it).

Every rank's return value comes back in rank order; an exception on any rank
is re-raised here with that rank's traceback, and a rank that hangs is killed
after ``timeout`` seconds.
"""
from __future__ import annotations

import io
import os
import traceback
from datetime import timedelta

import torch
import torch.multiprocessing as mp

from grpo_mega.distributed.state import free_port


def _worker(rank, world_size, port, fn, args, queue, backend="gloo"):
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
        queue.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the parent verbatim
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


PORT_TAKEN = "EADDRINUSE"
"""Rank 0's store could not listen: another process took the free port between
``free_port`` and the bind (two pytest-xdist workers launch ranks side by side)."""


def run_ranks(world_size: int, fn, *args, timeout: float = 600, backend: str = "gloo"):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks; returns
    their results in rank order. A port taken before rank 0 could bind it is retried on a
    new port (up to 3 tries; nothing has run by then)."""
    for attempt in range(3):
        results, errors, port_taken = _launch(world_size, fn, args, timeout, backend)
        if not port_taken:
            break
        print(f"[run_ranks] port taken before rank 0 bound it (try {attempt + 1} of 3); relaunching")
    if errors:
        raise AssertionError("distributed run failed:\n" + "\n".join(errors))
    if len(results) != world_size:
        missing = sorted(set(range(world_size)) - set(results))
        raise AssertionError(f"ranks {missing} produced no result (hung or crashed; timeout {timeout}s)")
    return [results[r] for r in range(world_size)]


def _launch(world_size: int, fn, args, timeout: float, backend: str) -> tuple[dict, list[str], bool]:
    """One launch: (results by rank, error reports, whether rank 0 found its port taken, in
    which case the other ranks are killed at once instead of waiting out the timeout)."""
    import time

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, backend))
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
        rank, ok, payload = queue.get()
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
        p.join(timeout=5)
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
