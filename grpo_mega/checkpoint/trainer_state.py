"""Checkpoint / resume with megatron-core distributed checkpointing.

A checkpoint holds the model (a LoRA model: its adapters alone, plus a reference to the
frozen base, ``lora_state``), the optimizer state (Adam moments, and fp32 master
weights when training in bf16, resharded like the model),
the step, the data position, the LR schedule position and the model shape, and,
once iterative GRPO has reset it (``algorithm.ref_reset_every``), the reference
model's weights under ``reference.<key>``. Before any reset the reference is the
initial weights, which the run rebuilds from its start-up checkpoint, so they are not
stored; ``grpo_meta.json`` says which case it is (``reference_stored``). It is saved
in megatron's ``torch_dist`` format, so a run saved at one TP/PP layout resumes at
another, the reference included. Per-rank RNG states are stored beside it and
restored only when the layout is unchanged (they have no meaning in another layout).

Atomicity: every rank writes into ``step_XXXXXXXX.tmp``; after a barrier rank 0
renames it to ``step_XXXXXXXX`` and only then replaces the ``latest`` pointer
(write-to-temp + ``os.replace``). The directory's layout, the ``keep_last`` rotation (by
save order), re-publishing a step and what a kill at each point leaves are in ``steps``;
what a load refuses (code in pickles, compressed entries, paths outside the checkpoint,
non-finite weights) is in ``io``.
"""
from __future__ import annotations

import dataclasses
import json
import os
from contextlib import nullcontext
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from grpo_mega.checkpoint import lora_state, steps
from grpo_mega.checkpoint.io import (CheckpointError, check_finite, check_object_entries, check_shard_files,
                                     find_corrupt_shard, in_process_write_results, load_plain, read_index,
                                     weights_only_loads)
from grpo_mega.distributed.state import ParallelState
from grpo_mega.runtime.faults import fault_point
from grpo_mega.models import sharded_state_dict

SHAPE_FIELDS = ("family", "vocab_size", "hidden_size", "num_layers", "num_attention_heads",
                "num_query_groups", "ffn_hidden_size", "qkv_bias", "tie_embeddings")
REFERENCE_PREFIX = "reference."


def _flatten(sd, prefix=""):
    for k, v in sd.items():
        if isinstance(v, dict):
            yield from _flatten(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _optimizer_sharded(model_sd: dict, optimizer) -> dict:
    """Adam moments as sharded tensors laid out exactly like their parameters."""
    by_ptr = {p.data_ptr(): p for p in optimizer.params}
    out = {}
    for path, sh in _flatten(model_sd):
        data = getattr(sh, "data", None)
        if not isinstance(data, torch.Tensor) or data.data_ptr() not in by_ptr:
            continue
        for name, tensor in optimizer.state_tensors(by_ptr[data.data_ptr()]).items():
            # Keyed by the local path: megatron's keys repeat across layers (the layer
            # is an extra sharded axis), so sh.key alone would collide. fp32 moments of
            # a bf16 parameter carry their own dtype.
            extra = {"dtype": tensor.dtype} if "dtype" in {f.name for f in dataclasses.fields(sh)} else {}
            # view: a LoRA fc1 B is stored as [2, F, r] over its local [2F/tp, r] (lora_state)
            out[f"{name}.{path}"] = dataclasses.replace(
                sh, key=f"optimizer.{name}.{sh.key}", data=tensor.view(data.shape), **extra)
    return out


def _reference_sharded(reference, ps: ParallelState) -> dict:
    """The reference model's weights as sharded tensors laid out like the policy's (so
    they reshard on load the same way), under keys of their own. ``_extra_state``
    objects are left out: a frozen copy needs only its weights."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.utils import add_prefix_for_sharding

    sd = {k: v for k, v in sharded_state_dict(reference, ps).items() if not isinstance(v, ShardedObject)}
    add_prefix_for_sharding(sd, REFERENCE_PREFIX)
    return sd


def _model_sharded(model, ps: ParallelState) -> dict:
    """What a checkpoint holds of the model: every parameter, or a LoRA model's adapters
    alone (``lora_state``; the frozen base is referenced, not stored)."""
    if lora_state.has_lora(model):
        from grpo_mega.models.gpt import unwrap_model
        return lora_state.lora_sharded_state_dict(model, ps, int(unwrap_model(model).config.num_layers))
    return sharded_state_dict(model, ps)


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _agree_or_raise(error: Optional[str]) -> None:
    """Collective: rank 0's error (or None) reaches every rank, and every rank raises it;
    a rank 0 that raised alone left the others in the next collective until its timeout."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise CheckpointError(error)


def latest_checkpoint(root: str | os.PathLike) -> Optional[Path]:
    """The checkpoint ``latest`` names, or None if there is none yet."""
    return steps.resolve_latest(Path(root))


RESUME_MODES = ("auto", "must", "never")


def resume_checkpoint(root: str | os.PathLike, mode: str) -> Optional[Path]:
    """The checkpoint a run resumes from under ``checkpoint.resume=mode``: ``auto`` the
    latest one or None, ``must`` the latest one or an error naming ``root``, ``never`` None."""
    if mode not in RESUME_MODES:
        raise CheckpointError(f"checkpoint.resume={mode!r} is not one of {RESUME_MODES} (--checkpoint.resume)")
    if mode == "never":
        return None
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} is a file, not a directory (--checkpoint.dir)")
    found = latest_checkpoint(root)
    if found is None and mode == "must":
        what = "has no 'latest' pointer" if root.is_dir() else "does not exist"
        raise CheckpointError(f"checkpoint.resume=must, but the checkpoint directory {root.resolve()} "
                              f"{what}; fix --checkpoint.dir or use --checkpoint.resume=auto")
    return found


def rng_state() -> dict:
    """This rank's RNG streams: the CPU generator, every CUDA device's generator, and
    megatron's named model-parallel streams (its tracker; CPU-forked ones on CPU). Dropout
    and sampling on GPU draw from the CUDA ones, so saving the CPU one alone did not
    resume a GPU run's randomness."""
    from megatron.core import tensor_parallel

    out = {"rng_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["rng_cuda"] = list(torch.cuda.get_rng_state_all())
    states = tensor_parallel.get_cuda_rng_tracker().get_states()
    # Graph-safe trackers hold torch.Generator objects: only plain state tensors are saved.
    out["rng_tracker"] = {k: v for k, v in states.items() if isinstance(v, torch.Tensor)}
    return out


def restore_rng(extra: dict) -> None:
    """Put back what ``rng_state`` saved (older checkpoints hold the CPU state only)."""
    from megatron.core import tensor_parallel

    torch.set_rng_state(extra["rng_cpu"])
    if extra.get("rng_cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(extra["rng_cuda"])
    tracker = tensor_parallel.get_cuda_rng_tracker()
    if extra.get("rng_tracker"):
        tracker.set_states({**tracker.get_states(), **extra["rng_tracker"]})


def _rank_state(path: Path, rank: int, allow_unsafe: bool) -> tuple[dict, dict]:
    """(this rank's saved extras or {}, any rank's); every rank saves the same Adam step,
    so a resume at a larger world reads it from rank 0's file."""
    mine = path / f"rank_{rank:05d}.pt"
    extra = load_plain(mine, allow_unsafe) if mine.exists() else {}
    if extra:
        return extra, extra
    first = path / "rank_00000.pt"
    if not first.exists():
        names = sorted({first.name, mine.name})
        raise CheckpointError(f"checkpoint {path} has no per-rank state file ({' or '.join(names)}); "
                              "it is incomplete: resume from another step_* directory")
    return extra, load_plain(first, allow_unsafe)


def save_checkpoint(root: str | os.PathLike, step: int, model, optimizer, ps: ParallelState,
                    common: dict, keep_last: int = 2, reference=None) -> Path:
    """Collective. ``common`` (JSON-able: data position, config, ...) is stored by rank 0.
    ``reference``: the reference model, when it is no longer the initial weights (after
    an iterative-GRPO reset); None stores none and records ``reference_stored: false``."""
    from megatron.core import dist_checkpointing

    root = Path(root)
    final = root / steps.step_name(step)
    tmp = final.with_name(final.name + ".tmp")
    error = None
    if ps.rank == 0:
        try:
            steps.begin(root, step)
        except CheckpointError as e:  # a foreign directory in the way: every rank stops
            error = str(e)
    _agree_or_raise(error)
    model_sd = _model_sharded(model, ps)
    # A DP-sharded optimizer gathers whole per-parameter state for the save, so the
    # files do not depend on dp (or on which optimizer wrote them).
    with optimizer.full_state():
        sharded = {"model": model_sd, "optimizer": _optimizer_sharded(model_sd, optimizer)}
        if reference is not None:
            sharded["reference"] = _reference_sharded(reference, ps)
        in_process_write_results()
        dist_checkpointing.save(sharded, str(tmp))
        fault_point("checkpoint.save")  # shards written, rank files and metadata not yet
    torch.save({**rng_state(), "layout": (ps.tp, ps.pp, ps.dp), "adam_step": optimizer.adam_step},
               tmp / f"rank_{ps.rank:05d}.pt")
    _barrier()
    if ps.rank == 0:
        meta = dict(common, step=step, layout={"tp": ps.tp, "pp": ps.pp, "dp": ps.dp},
                    reference_stored=reference is not None)
        if lora_state.has_lora(model):
            meta["lora"] = lora_state.base_reference(common.get("model") or {})
        steps.finish(root, tmp, meta, keep_last)
    _barrier()
    return final


def load_checkpoint(path: str | os.PathLike, model, optimizer, ps: ParallelState,
                    model_cfg=None, reference=None, allow_unsafe_load: bool = False,
                    allow_nonfinite: bool = False) -> dict:
    """Load into the built model (any layout) and optimizer; returns the saved common dict.
    ``reference``: the built reference model; loaded from the checkpoint when it holds one
    (``reference_stored``), else left as built (the initial weights).
    ``allow_unsafe_load``: unpickle files that hold more than tensors and plain data
    (``checkpoint.allow_unsafe_load``); refused by default, since that can run code.
    ``allow_nonfinite``: load NaN or infinite weights and optimizer state
    (``checkpoint.allow_nonfinite_weights``); refused by default, naming the tensors."""
    path = Path(path)
    meta_file = path / "grpo_meta.json"
    if not meta_file.exists():
        raise CheckpointError(f"{path} is not a complete grpo-mega checkpoint (no grpo_meta.json)")
    try:
        meta = json.loads(meta_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{meta_file} is corrupt ({e}); resume from another step_* directory") from None
    if model_cfg is not None and "model" in meta:
        saved = meta["model"]
        diff = {f: (saved.get(f), getattr(model_cfg, f)) for f in SHAPE_FIELDS
                if f in saved and saved.get(f) != getattr(model_cfg, f)}
        if diff:
            raise CheckpointError(
                f"checkpoint {path} was saved for a different model: "
                + ", ".join(f"model.{k}: checkpoint {a!r} vs config {b!r}" for k, (a, b) in diff.items())
                + "; fix --model.* or point --checkpoint.dir elsewhere")
    # LoRA: the adapters' shape and base are checked (the base's files hashed) on rank 0.
    error = None
    if ps.rank == 0:
        try:
            lora_state.check_base(meta, model_cfg, lora_state.has_lora(model), path)
        except CheckpointError as e:
            error = str(e)
    _agree_or_raise(error)
    # A DP-sharded optimizer takes its slices of the whole state (and, in fp32, its
    # master from the loaded weights) when this block ends.
    with optimizer.full_state(write_back=True) if optimizer is not None else nullcontext():
        _load_into(path, model, optimizer, ps, reference, meta, allow_unsafe_load, allow_nonfinite)
    return meta


def _load_into(path: Path, model, optimizer, ps: ParallelState, reference, meta: dict,
               allow_unsafe_load: bool, allow_nonfinite: bool) -> None:
    from megatron.core import dist_checkpointing

    lora = lora_state.has_lora(model)
    model_sd = _model_sharded(model, ps)
    sharded = {"model": model_sd}
    if optimizer is not None:
        sharded["optimizer"] = _optimizer_sharded(model_sd, optimizer)
    load_reference = reference is not None and bool(meta.get("reference_stored"))
    if load_reference:
        sharded["reference"] = _reference_sharded(reference, ps)
    # Every file megatron and torch would unpickle is checked first (code in a crafted
    # pickle runs on load), and the shard files against the index, so a damaged
    # checkpoint fails fast with the file named.
    index = read_index(path, allow_unsafe_load)
    check_shard_files(path, index)
    if not allow_unsafe_load:
        check_object_entries(path, index)
    if (path / "common.pt").is_file():
        load_plain(path / "common.pt", allow_unsafe_load)
    extra, any_rank = _rank_state(path, ps.rank, allow_unsafe_load) if optimizer is not None else ({}, {})
    from torch.distributed.checkpoint.api import CheckpointException
    try:
        with weights_only_loads(not allow_unsafe_load):
            loaded = dist_checkpointing.load(sharded, str(path))
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - the latter is a BaseException
        culprit = find_corrupt_shard(path, index) if index is not None else None
        raise CheckpointError(culprit or f"could not load checkpoint {path}: {e}") from e
    # torch has already copied the values into the model's tensors (its load is in place);
    # a refusal stops the run before a step or a save can use them.
    if not allow_nonfinite:
        check_finite(dict(_flatten(loaded)), path, device=getattr(ps, "device", None))
    if not lora:  # (adapters: torch loaded them in place, into views of the parameters)
        model.load_state_dict(loaded["model"], strict=False)
    if load_reference:
        reference.load_state_dict(loaded["reference"], strict=False)
    if optimizer is not None:
        by_key = {}
        for path_, sh in _flatten(model_sd):
            data = getattr(sh, "data", None)
            if isinstance(data, torch.Tensor):
                by_key[path_] = data
        by_ptr = {p.data_ptr(): p for p in optimizer.params}
        for name, tensor in loaded["optimizer"].items():
            moment, key = name.split(".", 1)
            p = by_ptr.get(by_key[key].data_ptr()) if key in by_key else None
            if p is not None:
                dst = optimizer.state_tensors(p)[moment]
                if dst.data_ptr() != tensor.data_ptr():  # (torch may have loaded it in place)
                    dst.copy_(tensor.view(dst.shape))
        optimizer.adam_step = float(any_rank.get("adam_step", 0.0))
        if extra and tuple(extra["layout"]) == (ps.tp, ps.pp, ps.dp):
            restore_rng(extra)
