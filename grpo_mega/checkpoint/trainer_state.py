"""Checkpoint / resume with megatron-core distributed checkpointing.

A checkpoint holds the model, the optimizer state (Adam moments, and fp32 master
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
(write-to-temp + ``os.replace``). A run killed at any point leaves ``latest``
naming a complete checkpoint; stale ``.tmp`` directories are removed by the next
save.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from grpo_mega.checkpoint.io import CheckpointError
from grpo_mega.distributed.state import ParallelState
from grpo_mega.faults import fault_point
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
            out[f"{name}.{path}"] = dataclasses.replace(
                sh, key=f"optimizer.{name}.{sh.key}", data=tensor, **extra)
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


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def latest_checkpoint(root: str | os.PathLike) -> Optional[Path]:
    """The checkpoint ``latest`` names, or None if there is none yet."""
    root = Path(root)
    pointer = root / "latest"
    if not pointer.exists():
        return None
    name = pointer.read_text().strip()
    path = root / name
    if not (path / "grpo_meta.json").exists():
        raise CheckpointError(f"{pointer} names {name}, but {path} is missing or incomplete; "
                              f"point 'latest' at a complete step_* directory or remove it")
    return path


def save_checkpoint(root: str | os.PathLike, step: int, model, optimizer, ps: ParallelState,
                    common: dict, keep_last: int = 2, reference=None) -> Path:
    """Collective. ``common`` (JSON-able: data position, config, ...) is stored by rank 0.
    ``reference``: the reference model, when it is no longer the initial weights (after
    an iterative-GRPO reset); None stores none and records ``reference_stored: false``."""
    from megatron.core import dist_checkpointing

    root = Path(root)
    final = root / f"step_{step:08d}"
    tmp = root / f"step_{step:08d}.tmp"
    if ps.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    model_sd = sharded_state_dict(model, ps)
    sharded = {"model": model_sd, "optimizer": _optimizer_sharded(model_sd, optimizer)}
    if reference is not None:
        sharded["reference"] = _reference_sharded(reference, ps)
    dist_checkpointing.save(sharded, str(tmp))
    fault_point("checkpoint.save")  # shards written, rank files and metadata not yet
    torch.save({"rng_cpu": torch.get_rng_state(), "layout": (ps.tp, ps.pp, ps.dp),
                "adam_step": optimizer.adam_step},
               tmp / f"rank_{ps.rank:05d}.pt")
    _barrier()
    if ps.rank == 0:
        meta = dict(common, step=step, layout={"tp": ps.tp, "pp": ps.pp, "dp": ps.dp},
                    reference_stored=reference is not None)
        (tmp / "grpo_meta.json").write_text(json.dumps(meta, indent=1, default=str))
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        pointer_tmp = root / "latest.tmp"
        pointer_tmp.write_text(final.name + "\n")
        os.replace(pointer_tmp, root / "latest")
        done = sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
        for old in done[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load_checkpoint(path: str | os.PathLike, model, optimizer, ps: ParallelState,
                    model_cfg=None, reference=None) -> dict:
    """Load into the built model (any layout) and optimizer; returns the saved common dict.
    ``reference``: the built reference model; loaded from the checkpoint when it holds one
    (``reference_stored``), else left as built (the initial weights)."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    meta_file = path / "grpo_meta.json"
    if not meta_file.exists():
        raise CheckpointError(f"{path} is not a complete grpo-mega checkpoint (no grpo_meta.json)")
    meta = json.loads(meta_file.read_text())
    if model_cfg is not None and "model" in meta:
        saved = meta["model"]
        diff = {f: (saved.get(f), getattr(model_cfg, f)) for f in SHAPE_FIELDS
                if f in saved and saved.get(f) != getattr(model_cfg, f)}
        if diff:
            raise CheckpointError(
                f"checkpoint {path} was saved for a different model: "
                + ", ".join(f"model.{k}: checkpoint {a!r} vs config {b!r}" for k, (a, b) in diff.items())
                + "; fix --model.* or point --checkpoint.dir elsewhere")
    model_sd = sharded_state_dict(model, ps)
    sharded = {"model": model_sd}
    if optimizer is not None:
        sharded["optimizer"] = _optimizer_sharded(model_sd, optimizer)
    load_reference = reference is not None and bool(meta.get("reference_stored"))
    if load_reference:
        sharded["reference"] = _reference_sharded(reference, ps)
    try:
        loaded = dist_checkpointing.load(sharded, str(path))
    except Exception as e:  # noqa: BLE001 - re-raised with the path and the fix
        raise CheckpointError(f"could not load checkpoint {path}: {e}") from e
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
        rank_file = path / f"rank_{ps.rank:05d}.pt"
        extra = torch.load(rank_file, weights_only=False) if rank_file.exists() else {}
        any_rank = extra or torch.load(next(path.glob("rank_*.pt")), weights_only=False)
        for name, tensor in loaded["optimizer"].items():
            moment, key = name.split(".", 1)
            p = by_ptr.get(by_key[key].data_ptr()) if key in by_key else None
            if p is not None:
                optimizer.state_tensors(p)[moment].copy_(tensor)
        optimizer.adam_step = float(any_rank.get("adam_step", 0.0))
        if extra and tuple(extra["layout"]) == (ps.tp, ps.pp, ps.dp):
            torch.set_rng_state(extra["rng_cpu"])
    return meta
