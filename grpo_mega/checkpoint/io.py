"""Checkpoint I/O shared by the trainer's checkpoints and the conversion tools: the one
error class, what a load refuses, the world that megatron's distributed checkpointing
needs, its writer, and atomic output (write into a temporary directory next to the target,
then rename), so a crash or a failed check never leaves a half-written checkpoint under
the final name.

Threat model of a load (resume, ``model.init_checkpoint``, ``tools/convert_checkpoint.py``):
the checkpoint's bytes may be hostile (downloaded, shared, or edited by someone else); the
code, the config and the flags are trusted. Unless the user passes
``checkpoint.allow_unsafe_load`` (for checkpoints they made themselves), a load

* runs no code from the files: every pickle is decoded with an allow-list first (torch's
  ``weights_only`` unpickler, or ``read_index``'s for the index), entries stored through a
  transform (torch's zstd compression, which ``weights_only`` checks never saw) are
  refused, and megatron's own load runs with torch's ``weights_only`` forced on
  (``weights_only_loads``), so its ``weights_only=False`` calls cannot unpickle objects;
* reads no file outside the checkpoint directory (the index's shard paths and links out
  are refused; ``latest`` is checked in ``steps``, ``weight_map`` in ``hf_files``);
* on resume and for ``model.init_checkpoint``, loads no NaN or infinite weight unless
  ``checkpoint.allow_nonfinite_weights`` (``check_finite``, which names the tensors); the
  conversion tool copies values as they are.

Not covered: a process with write access to the checkpoint directory while it is being
loaded (the checks and the load read the files twice), and flipped bytes inside a tensor's
payload (there is no checksum: they load as other finite weights)."""
from __future__ import annotations

import importlib
import io
import os
import pickle
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, malformed, or does not fit the config; the
    message names the directory (and the flag to change, where there is one)."""


Progress = Optional[Callable[[str], None]]

UNSAFE_FLAG = "--checkpoint.allow_unsafe_load=true"

# What torch's distributed-checkpoint index (``.metadata``, a plain pickle) may name:
# its own dataclasses and enums, dtypes, torch.Size and the layout lookup. A class
# there only rebuilds a record; anything else (os.system, builtins.exec, ...) is how a
# crafted pickle runs code, so it is refused before megatron unpickles the file.
_INDEX_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
                  "torch.distributed.checkpoint.filesystem")


def _index_global_ok(module: str, name: str) -> bool:
    if module == "torch.serialization" and name == "_get_layout":
        return True
    if module == "collections" and name == "OrderedDict":
        return True
    if module == "torch":
        obj = getattr(torch, name, None)
        return obj is torch.Size or isinstance(obj, torch.dtype)
    if module in _INDEX_MODULES:
        return isinstance(getattr(importlib.import_module(module), name, None), type)
    return False


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if not _index_global_ok(module, name):
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")
        return super().find_class(module, name)


def read_index(ckpt_dir: Path, allow_unsafe: bool, flag: str = UNSAFE_FLAG):
    """The distributed checkpoint's index (``.metadata``), unpickled with only the records
    torch writes there allowed (megatron would ``pickle.load`` it unrestricted); None when
    the directory has none (not a torch_dist checkpoint: megatron reports that)."""
    index = Path(ckpt_dir) / ".metadata"
    if not index.is_file():
        return None
    unpickler = pickle.Unpickler if allow_unsafe else _IndexUnpickler
    try:
        loaded = unpickler(io.BytesIO(index.read_bytes())).load()
    except pickle.UnpicklingError as e:
        if "is not allowed" not in str(e):
            raise CheckpointError(f"{index} is corrupt or truncated ({e}); resume from another "
                                  "step_* directory") from None
        raise CheckpointError(
            f"{index} is not a plain checkpoint index ({e}); loading it could run code from the "
            f"file. Pass {flag} only for checkpoints you made yourself") from None
    except Exception as e:  # noqa: BLE001 - any other failure is a damaged file
        raise CheckpointError(f"{index} is corrupt ({type(e).__name__}: {e}); resume from another "
                              "step_* directory") from None
    _check_index_entries(Path(ckpt_dir), loaded, allow_unsafe, flag)
    return loaded


def _check_index_entries(ckpt_dir: Path, index, allow_unsafe: bool, flag: str) -> None:
    """Every entry the index names lies in a file inside ``ckpt_dir`` and is stored plain.
    A transformed (zstd-compressed) entry is decoded by torch straight into its
    ``weights_only=False`` load of objects, past any check of the stored bytes; this
    project never writes one."""
    root = ckpt_dir.resolve()
    for idx, info in getattr(index, "storage_data", {}).items():
        rel = str(getattr(info, "relative_path", ""))
        if not rel or os.path.isabs(rel) or not (root / rel).resolve().is_relative_to(root):
            raise CheckpointError(f"{ckpt_dir / '.metadata'}: entry {idx.fqn!r} is stored in {rel!r}, "
                                  f"outside the checkpoint directory {ckpt_dir}; refusing to read it")
        if getattr(info, "transform_descriptors", None) and not allow_unsafe:
            raise CheckpointError(
                f"{ckpt_dir / rel}: entry {idx.fqn!r} is stored compressed ({', '.join(info.transform_descriptors)}); "
                "its bytes cannot be checked before torch unpickles them, which could run code from the file. "
                f"Pass {flag} only for checkpoints you made yourself")


def check_shard_files(ckpt_dir: Path, index) -> None:
    """Every shard file the index names exists and is long enough for its entries."""
    need: dict[str, int] = {}
    for info in getattr(index, "storage_data", {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    root = Path(ckpt_dir).resolve()
    for name, size in sorted(need.items()):
        f = Path(ckpt_dir) / name
        if f.exists() and not f.resolve().is_relative_to(root):
            raise CheckpointError(f"checkpoint shard {f} links to {f.resolve()}, outside the checkpoint "
                                  f"directory {ckpt_dir}; refusing to read it")
        if not f.is_file():
            raise CheckpointError(f"checkpoint shard {f} is missing (the index {Path(ckpt_dir) / '.metadata'} "
                                  "names it); the checkpoint is incomplete: resume from another step_* directory")
        if f.stat().st_size < size:
            raise CheckpointError(f"checkpoint shard {f} is truncated: {f.stat().st_size} bytes, the index "
                                  f"needs {size}; resume from another step_* directory")


def _entries(ckpt_dir: Path, index, bytes_only: bool = False):
    """(index key, file, the entry's bytes) for each entry of the shard files."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    kinds = getattr(index, "state_dict_metadata", {})
    for idx, info in getattr(index, "storage_data", {}).items():
        if bytes_only and not isinstance(kinds.get(idx.fqn), BytesStorageMetadata):
            continue
        if info.transform_descriptors:  # read_index refused it unless the user opted in
            continue
        f = Path(ckpt_dir) / info.relative_path
        with open(f, "rb") as fh:
            fh.seek(info.offset)
            yield idx, f, fh.read(info.length)


def _blocked_global(e: BaseException) -> Optional[str]:
    """The global a ``weights_only`` load refused, or None when it failed otherwise."""
    m = re.search(r"unsupported (?:global: )?GLOBAL ([\w.]+)", str(e), re.IGNORECASE)
    return m.group(1) if m else None


def check_object_entries(ckpt_dir: Path, index) -> None:
    """torch's loader unpickles the objects in a checkpoint (megatron's ShardedObjects,
    e.g. ``_extra_state``) with ``weights_only=False``; decode each restricted first."""
    for idx, f, chunk in _entries(ckpt_dir, index, bytes_only=True):
        try:
            torch.load(io.BytesIO(chunk), map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - reported with the file
            name = _blocked_global(e)
            if name is None:
                raise CheckpointError(f"checkpoint shard {f} is corrupt: entry {idx.fqn!r} does not decode "
                                      f"({type(e).__name__}); resume from another step_* directory") from None
            raise CheckpointError(
                f"checkpoint shard {f}: entry {idx.fqn!r} names {name}; unpickling it could run code "
                f"from the file. Pass {UNSAFE_FLAG} only for checkpoints you made yourself") from None


@contextmanager
def weights_only_loads(enabled: bool = True) -> Iterator[None]:
    """Within the block, every ``torch.load`` is ``weights_only`` even where the caller
    asked for ``weights_only=False`` (torch's ``TORCH_FORCE_WEIGHTS_ONLY_LOAD``): megatron
    and torch load a checkpoint's object entries that way. The entries were decoded with
    ``weights_only`` before (``check_object_entries``); this keeps a file that changed since,
    or an entry that check did not see, from running code."""
    var = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
    before = os.environ.get(var)
    if enabled:
        os.environ[var] = "1"
    try:
        yield
    finally:
        if enabled:
            if before is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = before


NONFINITE_FLAG = "--checkpoint.allow_nonfinite_weights=true"


def check_finite(tensors: dict, where: Path, device: Any = None, flag: str = NONFINITE_FLAG) -> None:
    """Refuse NaN or infinite values in ``tensors`` (name -> tensor; other values are
    skipped), naming them. Collective when a world of several ranks is up (each rank holds
    its own shards): every rank raises, not only the one holding the bad shard, which would
    leave the others waiting in the next collective."""
    bad = [name for name, t in tensors.items()
           if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all())]
    total = len(bad)
    if dist.is_initialized() and dist.get_world_size() > 1:
        count = torch.tensor([float(total)], device=device if device is not None else "cpu")
        dist.all_reduce(count)
        total = int(count.item())
    if total:
        named = ", ".join(bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "") if bad else \
            "tensors held by other ranks"
        raise CheckpointError(f"checkpoint {where} holds NaN or infinite values in {named}; resume from an "
                              f"earlier step_* directory, or pass {flag} to load them anyway")


def find_corrupt_shard(ckpt_dir: Path, index) -> Optional[str]:
    """After a failed load: decode every entry of every shard file on its own and name
    the first that fails (the sharded loader's error does not say which file)."""
    for idx, f, chunk in _entries(ckpt_dir, index):
        try:
            torch.load(io.BytesIO(chunk), map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - reported with the file
            return (f"checkpoint shard {f} is corrupt: entry {idx.fqn!r} does not decode "
                    f"({type(e).__name__}); resume from another step_* directory")
    return None


def load_plain(file: Path, allow_unsafe: bool) -> Any:
    """``torch.load`` of a small per-rank file: tensors and plain containers only
    (``weights_only=True``) unless the user opted in to unpickling arbitrary objects."""
    try:
        return torch.load(file, map_location="cpu", weights_only=not allow_unsafe)
    except pickle.UnpicklingError as e:
        # torch reports a disallowed global as "Unsupported global: GLOBAL mod.name"; any
        # other unpickling failure is a damaged file.
        name = _blocked_global(e)
        if name is None:
            raise CheckpointError(f"{file} is corrupt or truncated (UnpicklingError); "
                                  "resume from another step_* directory") from None
        e = f"it names {name}"
        raise CheckpointError(
            f"{file} holds Python objects beyond tensors and plain data ({e}); unpickling them "
            f"could run code from the file. Re-save it, or pass {UNSAFE_FLAG} only for a "
            "checkpoint you made yourself") from None
    except (OSError, RuntimeError, EOFError) as e:
        raise CheckpointError(f"{file} is corrupt or truncated ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}); "
                              "resume from an earlier step_* directory") from None


def _ensure_world() -> None:
    """dist_checkpointing needs torch.distributed (and, without CUDA, the CPU patches:
    its writer calls torch.cuda.synchronize); start a 1-rank gloo world if needed."""
    from grpo_mega.distributed import cpu_compat

    cpu_compat.apply()  # no-op when CUDA is present
    if dist.is_initialized():
        return
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Under torchrun: join its world (gloo: the conversion's tensors are on the host),
        # so the ranks share the work and one of them publishes --out. A 1-rank world in
        # every process made each one convert everything and race on the rename.
        dist.init_process_group("gloo", init_method="env://")
        return
    # A file rendezvous: a free TCP port picked here can be taken by another process
    # before gloo binds it (EADDRINUSE on a busy machine).
    fd, path = tempfile.mkstemp(prefix="grpo_mega_world_")
    os.close(fd)
    os.unlink(path)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)


def _save_strategy():
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    in_process_write_results()
    # One writer thread per rank: the checkpoint is written once, 2 threads only add files.
    return TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)


def in_process_write_results() -> None:
    """Give megatron's checkpoint writer an in-process queue for its write results, before
    its first save in this process.

    Left alone, the writer's first save starts a ``multiprocessing`` Manager server with
    the *spawn* method, a fresh interpreter that must import torch to unpickle the write
    results it is sent: 2.3 CPU-s in every rank that saves (measured here), and a process
    that can outlive a killed rank. The queue only carries results between the writer's
    threads and the caller, both in this process, because every save here is synchronous
    (megatron's ``execute_sync``; nothing uses its async save, whose writer process would
    need the Manager). Idempotent; a no-op where megatron's module layout differs."""
    import queue

    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
    except ImportError:  # pragma: no cover - other megatron layouts
        return
    if getattr(fa, "_results_queue", "absent") is None:
        fa._results_queue = queue.Queue()


def release_checkpoint_writer() -> None:
    """Shut down a multiprocessing Manager that megatron's checkpoint writer may have
    started (a save that did not go through ``in_process_write_results``). A process that
    exits normally does this itself; call it before a process may be killed instead (a
    test harness), since the Manager's server would outlive it and hold its stdout open."""
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
    """Rename the finished ``tmp`` to ``out``. An ``out`` it replaces (``overwrite``) is
    renamed to ``<out>.old`` first and deleted only once ``tmp`` is in place, so a kill at
    any moment leaves a complete directory (the old or the new) and at most that sibling."""
    if out.exists() and not overwrite:
        raise CheckpointError(f"output directory {out} already exists")
    old = out.with_name(out.name + ".old")
    if old.exists():  # a kill after the last publish's rename: out is the newer copy
        shutil.rmtree(old)
    if out.exists():
        os.rename(out, old)
    os.rename(tmp, out)
    if old.exists():
        shutil.rmtree(old)


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
