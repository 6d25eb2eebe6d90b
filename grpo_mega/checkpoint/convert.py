"""HF <-> megatron-core checkpoint conversion, and loading weights into a built model.

What:
  hf_to_mcore(hf_dir, out_dir)     HF safetensors -> megatron-core distributed checkpoint
                                   (torch_dist) holding canonical, *unsharded* tensors,
                                   which ``load_mcore_weights`` loads at any TP/PP layout
  mcore_to_hf(ckpt_dir, out_dir)   the inverse (also reads checkpoints the trainer saved
                                   with ``model.sharded_state_dict()``)
  load_mcore_weights(model, dir, ps)  trainer: load into this rank's built model
  load_hf_weights(model, dir, ps)     trainer: start straight from an HF checkpoint

All names and layouts come from ``grpo_mega.models.hf`` (the same table the weight
bridge uses). The checkpoint keys are megatron's own sharded keys: layers are one
tensor with a leading layer axis (``decoder.layers.self_attention.linear_qkv.weight``
[L, ...]); the norms use the Transformer Engine spec's keys whatever the layer spec: TE fuses
the pre-attention norm, and a dense model's pre-MLP norm, into the next linear
(``...linear_qkv.layer_norm_weight``), while an MoE layer keeps a real
``pre_mlp_layernorm`` (``models.gpt.layer_spec`` makes the local spec agree); linear_fc1 is [gate; up]
globally; the vocabulary is stored unpadded (megatron marks the embedding and output
layer ``allow_shape_mismatch``, so each TP layout pads on load).

Memory: tensors stream one by one through ``safetensors.safe_open``; hf_to_mcore holds
the converted model once (split over ranks when run under torchrun), mcore_to_hf one
layer plus one output shard. Output goes to a temporary directory next to ``out_dir``
that is renamed at the end, so a failed conversion leaves nothing behind.

Saving needs ``psutil`` and, in a script, the work inside ``if __name__ == "__main__":``
(megatron's writer starts a multiprocessing Manager that re-imports ``__main__``).

HF file handling is in ``hf_files``, atomic output and the error class in ``io``, logit
verification in ``verify``. CLIs: ``tools/convert_checkpoint.py`` and ``tools/verify_checkpoint.py``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from grpo_mega.checkpoint.hf_files import (HF_SIDE_FILES, HFReader, _ShardWriter, check_hf_checkpoint,
                                           read_hf_config)
from grpo_mega.checkpoint.io import (CheckpointError, Progress, _check_out, _ensure_world, check_finite,
                                     read_index, weights_only_loads,
                                     _publish_collectively, _save_strategy, _say, _shared_tmp_dir,
                                     release_checkpoint_writer)
from grpo_mega.config import ModelConfig
from grpo_mega.models import hf as mapping
from grpo_mega.models.hf import MissingTensorError, ShapeMismatchError
from grpo_mega.models.hf_config import hf_config_from_model_config, model_config_from_hf
from grpo_mega.runtime.console import bar as progress_bar
from grpo_mega.runtime.console import shown

__all__ = [
    "CheckpointError", "hf_to_mcore", "mcore_to_hf", "load_mcore_weights", "load_hf_weights",
    "read_model_config", "release_checkpoint_writer", "checkpoint_key", "HFReader", "META_FILE", "FORMAT",
]

FORMAT = "grpo-mega/mcore-weights/1"
META_FILE = "grpo_mega.json"
HF_SIDE_DIR = "hf"  # config.json, generation_config.json, tokenizer files of the source




# =============================================================================== mcore side

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")
# megatron's sharded keys use the Transformer Engine names of the fused norms. An MoE layer's
# pre-MLP norm is not fused (the TE spec builds a TENorm ``pre_mlp_layernorm``).
_KEY_RENAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight"}
_DENSE_KEY_RENAMES = {**_KEY_RENAMES, "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
_LEGACY_MOE_NORM_KEY = "decoder.layers.mlp.linear_fc1.layer_norm_weight"


def checkpoint_key(name: str, cfg: ModelConfig) -> tuple[str, tuple[int, ...]]:
    """(megatron sharded key, indices on its prepended axes) of a canonical tensor of model
    ``cfg``: () for a non-layer tensor, (layer,) for a layer's, (layer, expert) for an
    expert's (megatron's SequentialMLP and TE's grouped experts both stack experts on a
    second axis: ``decoder.layers.mlp.experts.experts.*``)."""
    m = _LAYER.match(name)
    if not m:
        return name, ()
    renames = _KEY_RENAMES if cfg.num_experts else _DENSE_KEY_RENAMES
    rest = renames.get(m.group(2), m.group(2))
    e = _EXPERT.match(rest)
    if e:
        return f"decoder.layers.mlp.experts.experts.{e.group(2)}", (int(m.group(1)), int(e.group(1)))
    return f"decoder.layers.{rest}", (int(m.group(1)),)


def _axis_sizes(cfg: ModelConfig, n: int) -> tuple[int, ...]:
    """Sizes of the first ``n`` prepended axes: layers, then experts."""
    return (cfg.num_layers, cfg.num_experts)[:n]


def _expected_keys(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Sharded key -> global shape (layers, experts stacked on leading axes; vocab unpadded)."""
    out = {}
    for name in mapping.canonical_names(cfg):
        key, axes = checkpoint_key(name, cfg)
        out[key] = _axis_sizes(cfg, len(axes)) + mapping.canonical_shape(name, cfg)
    return out


def _validate_checkpoint(meta: dict, cfg: ModelConfig, ckpt_dir) -> None:
    """Compare the checkpoint's global shapes with the config before any load: the
    vocabulary tensors load with allow_shape_mismatch, so a wrong vocabulary would
    otherwise load silently (partly zero)."""
    for key, want in _expected_keys(cfg).items():
        if key not in meta:
            legacy = cfg.num_experts and _LEGACY_MOE_NORM_KEY in meta
            raise MissingTensorError(
                f"checkpoint {ckpt_dir} has no tensor {key!r} (expected shape {want} for {cfg.family})"
                + (f"; it holds {_LEGACY_MOE_NORM_KEY!r}, where MoE checkpoints written before "
                   "the Transformer Engine key fix keep that norm: convert the model again from HF "
                   "(tools/convert_checkpoint.py)" if legacy else ""))
        got = tuple(meta[key].global_shape)
        vocab_ok = (key in ("embedding.word_embeddings.weight", "output_layer.weight")
                    and got[1:] == want[1:] and got[0] >= want[0]
                    and got[0] % cfg.make_vocab_size_divisible_by == 0)  # megatron-padded rows
        if got != want and not vocab_ok:
            raise ShapeMismatchError(f"{key}: checkpoint shape {got} != expected {want} from the "
                                     f"model config ({mapping.config_summary(cfg)})")


def read_model_config(path: str | os.PathLike) -> ModelConfig:
    """ModelConfig of an mcore checkpoint written by hf_to_mcore, or of an HF directory."""
    p = Path(path)
    if (p / META_FILE).is_file():
        meta = json.loads((p / META_FILE).read_text())
        return ModelConfig(**meta["model"])
    return model_config_from_hf(read_hf_config(p), source=str(p / "config.json"))


# =============================================================================== HF -> mcore

def _owners(names: list[str], cfg: ModelConfig, world: int) -> dict[str, int]:
    """Spread tensors over ranks by bytes (largest first onto the least loaded rank)."""
    sizes = {n: int(torch.Size(mapping.canonical_shape(n, cfg)).numel()) for n in names}
    load, owner = [0] * world, {}
    for n in sorted(names, key=lambda n: -sizes[n]):
        r = min(range(world), key=load.__getitem__)
        owner[n] = r
        load[r] += sizes[n]
    return owner


def hf_to_mcore(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                overwrite: bool = False, progress: Progress = print, bar: bool = False) -> Path:
    """Convert an HF checkpoint to a megatron-core torch_dist checkpoint in ``out_dir``.

    ``bar``: a progress bar over the tensors on a terminal (``grpo_mega.runtime.console``), in
    place of a ``progress`` line per tensor.

    Runs in one process or collectively under torchrun (each rank converts and writes
    a share of the tensors). Shapes are checked against config.json first, from the
    safetensors headers, before anything is written.
    """
    hf_dir, out = Path(hf_dir), Path(out_dir)
    hf_config = read_hf_config(hf_dir)
    cfg = model_config_from_hf(hf_config, source=str(hf_dir / "config.json"))
    reader = HFReader(hf_dir)
    check_hf_checkpoint(reader, cfg)
    _check_out(out, overwrite)

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    _ensure_world()
    rank, world = dist.get_rank(), dist.get_world_size()
    names = mapping.canonical_names(cfg)
    owner = _owners(names, cfg, world)
    tmp = _shared_tmp_dir(out)
    try:
        start = time.perf_counter()
        sharded = {}
        mine = [n for n in names if owner[n] == rank]
        tensors = progress_bar(mine, desc=f"[hf-to-mcore]{f' rank {rank}' if world > 1 else ''} tensors",
                               unit="tensor", enabled=bar)
        for i, name in enumerate(tensors):
            t = mapping.hf_to_canonical(name, reader.get, cfg)
            key, axes = checkpoint_key(name, cfg)
            offsets = [(ax, idx, size) for ax, (idx, size)
                       in enumerate(zip(axes, _axis_sizes(cfg, len(axes))))]
            sharded[name] = ShardedTensor.from_rank_offsets(key, t, *offsets, replica_id=0,
                                                            prepend_axis_num=len(axes))
            if not shown(tensors):
                _say(progress, f"[hf-to-mcore]{f' rank {rank}' if world > 1 else ''} "
                               f"{i + 1}/{len(mine)} {name} {tuple(t.shape)} {t.dtype}")
        tensors.close()
        _say(progress, f"[hf-to-mcore] writing torch_dist checkpoint ({len(names)} tensors)")
        dist_checkpointing.save(sharded, str(tmp), sharded_strategy=_save_strategy())
        if rank == 0:
            _write_side_files(tmp, hf_dir, cfg, hf_config)
        _publish_collectively(tmp, out, overwrite)
        _say(progress, f"[hf-to-mcore] done: {out} ({time.perf_counter() - start:.1f} s)")
        return out
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_side_files(tmp: Path, hf_dir: Path, cfg: ModelConfig, hf_config: dict) -> None:
    side = tmp / HF_SIDE_DIR
    side.mkdir()
    for f in HF_SIDE_FILES:
        if (hf_dir / f).is_file():
            shutil.copyfile(hf_dir / f, side / f)
    meta = {"format": FORMAT, "model": dataclasses.asdict(cfg), "source": str(hf_dir)}
    (tmp / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")


# =============================================================================== mcore -> HF

def _require_dist_checkpoint(ckpt_dir: Path) -> None:
    if not (ckpt_dir / "metadata.json").is_file():
        raise CheckpointError(f"{ckpt_dir}: not a megatron-core distributed checkpoint "
                              "(no metadata.json)")


UNSAFE_CONVERT_FLAG = ("--checkpoint.allow_unsafe_load=true (for model.init_checkpoint) or "
                       "--allow-unsafe-load (tools/convert_checkpoint.py)")


def _load_tensors_metadata(ckpt_dir: Path, allow_unsafe_load: bool = False) -> dict:
    from megatron.core import dist_checkpointing

    _require_dist_checkpoint(ckpt_dir)
    # megatron unpickles the index unrestricted; only tensors are loaded from the shards.
    read_index(ckpt_dir, allow_unsafe_load, flag=UNSAFE_CONVERT_FLAG)
    return dict(dist_checkpointing.load_tensors_metadata(str(ckpt_dir)))


def _groups(cfg: ModelConfig) -> list[list[str]]:
    """Canonical names loaded together: non-layer tensors, then one layer at a time."""
    names = mapping.canonical_names(cfg)
    head = [n for n in names if _LAYER.match(n) is None]
    groups = [[n for n in head if n.startswith("embedding")]]
    for i in range(cfg.num_layers):
        groups.append([n for n in names if n.startswith(f"decoder.layers.{i}.")])
    groups.append([n for n in head if not n.startswith("embedding")])
    return [g for g in groups if g]


def _load_group(group: list[str], meta: dict, ckpt_dir: Path, cfg: ModelConfig) -> dict:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    sharded = {}
    for name in group:
        key, axes = checkpoint_key(name, cfg)
        md = meta[key]
        shape = tuple(md.global_shape)
        n = len(axes)
        # A [1, (1,) ...] slice of the stacked tensor (not prepended axes: torch's legacy
        # ShardedTensor path would then demand every layer on this rank).
        offsets = [(ax, idx, size) for ax, (idx, size) in enumerate(zip(axes, shape[:n]))]
        sharded[name] = ShardedTensor.from_rank_offsets(
            key, torch.empty((1,) * n + shape[n:], dtype=md.dtype), *offsets, replica_id=0)
    # One layer of a stacked tensor is a partial read, which the access-pattern check
    # (meant for whole-model loads) would reject.
    loaded = dist_checkpointing.load(sharded, str(ckpt_dir), validate_access_integrity=False)
    return {n: t.reshape(t.shape[len(checkpoint_key(n, cfg)[1]):]) for n, t in loaded.items()}


def mcore_to_hf(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                hf_config_dir: str | os.PathLike | None = None, overwrite: bool = False,
                max_shard_bytes: int = 5 * 2**30, progress: Progress = print, bar: bool = False,
                allow_unsafe_load: bool = False) -> Path:
    """Convert a megatron-core torch_dist checkpoint back to an HF checkpoint.

    ``bar``: a progress bar over the tensor groups on a terminal, in place of a line each.

    The model config comes from the checkpoint's ``grpo_mega.json`` (written by
    hf_to_mcore) or from ``hf_config_dir``'s config.json; config.json and tokenizer
    files are copied from the checkpoint's ``hf/`` side directory or ``hf_config_dir``.
    Collective under torchrun (every rank reads; rank 0 writes). ``allow_unsafe_load``:
    unpickle an index that names more than torch's checkpoint records (can run code).
    """
    ckpt, out = Path(ckpt_dir), Path(out_dir)
    if not ckpt.is_dir():
        raise CheckpointError(f"checkpoint directory {ckpt} does not exist")
    src = Path(hf_config_dir) if hf_config_dir else ckpt / HF_SIDE_DIR
    if hf_config_dir is not None:
        cfg = model_config_from_hf(read_hf_config(src), source=str(src / "config.json"))
    elif (ckpt / META_FILE).is_file():
        cfg = read_model_config(ckpt)
    else:
        raise CheckpointError(f"{ckpt} has no {META_FILE}; pass hf_config_dir (--hf-config) with "
                              "the model's config.json")
    _check_out(out, overwrite)
    _require_dist_checkpoint(ckpt)
    _ensure_world()
    meta = _load_tensors_metadata(ckpt, allow_unsafe_load)
    _validate_checkpoint(meta, cfg, ckpt)
    rank = dist.get_rank()
    tmp = _shared_tmp_dir(out)
    try:
        start = time.perf_counter()
        writer = _ShardWriter(tmp, max_shard_bytes)
        groups = _groups(cfg)
        steps = progress_bar(groups, desc="[mcore-to-hf] groups", unit="group", enabled=bar and rank == 0)
        for g, group in enumerate(steps):
            loaded = _load_group(group, meta, ckpt, cfg)
            for name in group:
                pairs = mapping.canonical_to_hf(name, loaded.pop(name), cfg)
                if rank == 0:
                    writer.add(pairs)
            if not shown(steps):
                _say(progress, f"[mcore-to-hf] {g + 1}/{len(groups)} loaded {', '.join(group[:2])}"
                               f"{' ...' if len(group) > 2 else ''}")
        steps.close()
        if rank == 0:
            files = writer.finish()
            _write_hf_side_files(tmp, src, cfg)
            _say(progress, f"[mcore-to-hf] wrote {', '.join(files)} ({writer.total / 1e6:.1f} MB)")
        _publish_collectively(tmp, out, overwrite)
        _say(progress, f"[mcore-to-hf] done: {out} ({time.perf_counter() - start:.1f} s)")
        return out
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_hf_side_files(tmp: Path, src: Path, cfg: ModelConfig) -> None:
    copied = False
    for f in HF_SIDE_FILES:
        if (src / f).is_file():
            shutil.copyfile(src / f, tmp / f)
            copied |= f == "config.json"
    if not copied:
        cfg_json = hf_config_from_model_config(cfg)
        (tmp / "config.json").write_text(json.dumps(cfg_json, indent=2, sort_keys=True) + "\n")


# =============================================================================== trainer loading

def _is_adapter(name: str) -> bool:
    """A LoRA adapter parameter (``grpo_mega.lora``), which base checkpoints do not hold."""
    return ".lora_A." in name or ".lora_B." in name


def load_mcore_weights(model, ckpt_dir: str | os.PathLike, ps, model_cfg: Optional[ModelConfig] = None,
                       allow_unsafe_load: bool = False, allow_nonfinite: bool = False) -> None:
    """Load a torch_dist checkpoint into this rank's built model (any TP/PP layout).

    Collective over all ranks. Goes through ``model.sharded_state_dict()``, so megatron
    reshards (TP slices, fc1 halves, layer offsets of this stage, vocabulary padding,
    the tied output layer on the last stage). Global shapes are checked against
    ``model_cfg`` (default: the checkpoint's own grpo_mega.json, if any) first.
    ``allow_unsafe_load``: as in :func:`mcore_to_hf`. ``allow_nonfinite``: load NaN or
    infinite weights (``checkpoint.allow_nonfinite_weights``); refused by default, naming them.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from grpo_mega.models import unwrap_model

    ckpt = Path(ckpt_dir)
    meta = _load_tensors_metadata(ckpt, allow_unsafe_load)
    if model_cfg is None and (ckpt / META_FILE).is_file():
        model_cfg = read_model_config(ckpt)
    if model_cfg is not None:
        _validate_checkpoint(meta, model_cfg, ckpt)
    model = unwrap_model(model)
    from grpo_mega.models import sharded_state_dict
    # _extra_state: nothing to restore for weights; LoRA adapters: not part of a base checkpoint
    sharded = {k: v for k, v in sharded_state_dict(model, ps).items()
               if not isinstance(v, ShardedObject) and not _is_adapter(k)}
    with weights_only_loads(not allow_unsafe_load):
        loaded = dist_checkpointing.load(sharded, str(ckpt))
    if not allow_nonfinite:  # collective, like the load
        check_finite(loaded, ckpt, device=getattr(ps, "device", None))
    result = model.load_state_dict(loaded, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state") and not _is_adapter(k)]
    if missing or result.unexpected_keys:
        raise CheckpointError(f"loading {ckpt} left parameters unset: {missing[:10]} "
                              f"(unexpected: {result.unexpected_keys[:10]})")


def load_hf_weights(model, hf_dir: str | os.PathLike, ps, model_cfg: Optional[ModelConfig] = None) -> None:
    """Load an HF checkpoint straight into this rank's built model, tensor by tensor
    (each rank reads only what its shard needs). Not collective."""
    from grpo_mega.models import layout as mcore_layout
    from grpo_mega.models import unwrap_model

    cfg = model_cfg or model_config_from_hf(read_hf_config(hf_dir),
                                             source=str(Path(hf_dir) / "config.json"))
    reader = HFReader(hf_dir)
    check_hf_checkpoint(reader, cfg)
    per = cfg.num_layers // ps.pp
    model = unwrap_model(model)
    off = mcore_layout.expert_offset(model, ps)
    with torch.no_grad():
        for local_name, p in model.named_parameters():
            if _is_adapter(local_name):
                continue  # LoRA adapters start from their init, not from the base
            name = mcore_layout.to_global_name(local_name, ps.pp_rank, per, off)
            if name == "output_layer.weight" and cfg.tie_embeddings:
                name = "embedding.word_embeddings.weight"  # the last stage's tied copy
            full = mapping.hf_to_canonical(name, reader.get, cfg)
            padded = p.shape[0] * ps.tp if name in mcore_layout.VOCAB_PARAMS else None
            shard = mcore_layout.shard(name, full, ps.tp_rank, ps.tp, padded)
            if shard.shape != p.shape:
                raise ShapeMismatchError(f"{name}: shard shape {tuple(shard.shape)} != parameter "
                                         f"shape {tuple(p.shape)}")
            p.copy_(shard)


