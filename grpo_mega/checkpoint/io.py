"""Checkpoint I/O shared by the trainer's checkpoints and the conversion tools: the one
error class, the world that megatron's distributed checkpointing needs, its writer, and
atomic output (write into a temporary directory next to the target, then rename), so a
crash or a failed check never leaves a half-written checkpoint under the final name."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Optional

import torch.distributed as dist


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, malformed, or does not fit the config; the
    message names the directory (and the flag to change, where there is one)."""


Progress = Optional[Callable[[str], None]]


def _ensure_world() -> None:
    """dist_checkpointing needs torch.distributed (and, without CUDA, the CPU patches:
    its writer calls torch.cuda.synchronize); start a 1-rank gloo world if needed."""
    from grpo_mega.distributed import cpu_compat

    cpu_compat.apply()  # no-op when CUDA is present
    if dist.is_initialized():
        return
    # A file rendezvous: a free TCP port picked here can be taken by another process
    # before gloo binds it (EADDRINUSE on a busy machine).
    fd, path = tempfile.mkstemp(prefix="grpo_mega_world_")
    os.close(fd)
    os.unlink(path)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)


def _save_strategy():
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    # One writer thread per rank: the checkpoint is written once, 2 threads only add files.
    return TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)


def release_checkpoint_writer() -> None:
    """Shut down the multiprocessing Manager that megatron's checkpoint writer starts on
    its first save and keeps for later saves. A process that exits normally does this
    itself; call it before a process may be killed instead (a test harness), since the
    Manager's server would outlive it and hold its stdout open."""
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
    except ImportError:  # pragma: no cover - other megatron layouts
        return
    manager = getattr(getattr(fa, "_results_queue", None), "_manager", None)
    if manager is not None:
        fa._results_queue = None
        manager.shutdown()


def _tmp_dir_for(out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))


def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not overwrite:
        raise CheckpointError(f"output directory {out} already exists (pass overwrite=True / --overwrite)")


def _publish(tmp: Path, out: Path, overwrite: bool) -> None:
    if out.exists():
        if not overwrite:
            raise CheckpointError(f"output directory {out} already exists")
        shutil.rmtree(out)
    os.rename(tmp, out)


def _publish_collectively(tmp: Path, out: Path, overwrite: bool) -> None:
    """Every rank has finished writing into ``tmp``; rank 0 renames it to ``out``."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        dist.barrier()
    if world == 1 or dist.get_rank() == 0:
        _publish(tmp, out, overwrite)
    if world > 1:
        dist.barrier()


def _shared_tmp_dir(out: Path) -> Path:
    """Rank 0 makes the temporary directory; every rank learns its name."""
    box = [str(_tmp_dir_for(out)) if dist.get_rank() == 0 else None]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return Path(box[0])


def _say(progress: Progress, msg: str) -> None:
    if progress is not None:
        progress(msg)
