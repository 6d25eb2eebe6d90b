"""Bucketed export of a megatron model's weights as HF-named full tensors.

What: from any TP x PP x DP layout, every rank (or every stage, with
``all_stages=False``) gets the model's HF tensors in buckets of about
``bucket_bytes``:

1. Each pipeline stage walks its own parameters, grouped by megatron module, with
   global layer indices. Per tensor, the TP shards are all-gathered into the
   canonical full tensor (``models.layout.gather``: grouped QKV, [gate; up] fc1
   halves, vocabulary padding removed) and turned into HF tensors by the family's
   mapping table (``models.hf.canonical_to_hf``). The tied output layer is skipped
   (the embedding is exported once, from stage 0).
2. A unit is never split over two buckets: vLLM reprocesses a fused layer
   (qkv_proj = q, k, v weights and biases; gate_up_proj) once all its tensors
   arrived, and a partial update silently corrupts it. A unit is one megatron module,
   except for MoE experts: all experts of one MoE layer are one unit, because vLLM
   reloads a layer's experts (every gate, up and down) as one fused tensor pair.
3. With PP > 1 every engine needs every stage's weights, so stages take turns:
   stage s broadcasts its buckets over the PP group one at a time (a name/shape
   header, then the tensors). No rank ever holds more than about one bucket plus
   one unit's gathered tensors; nobody gathers the whole model.
4. MoE at EP > 1: within a stage, the attention / router / norm modules are the same on
   every EP rank and each rank yields them itself; the experts (each EP rank holds a
   block of them) are exchanged one MoE layer at a time: each EP rank broadcasts its
   block of that layer over the EP group in turn, in the same header-then-tensors form,
   so every rank of the stage yields every expert of the layer in one bucket and none
   holds more than one layer of other ranks' experts (plus the bucket). Step 3 then
   carries the whole stage to the other stages.
5. LoRA (``model.lora``): adapter parameters are never exported as tensors of their own.
   An adapted linear's weight is sent merged, W + scale * B A on the local shard, then
   gathered and mapped like any weight (``model.lora.sync: merged``, and the HF export);
   ``export_adapter_buckets`` sends the adapter alone in PEFT names (``sync: adapter``).
"""
from __future__ import annotations

from typing import Iterator, Optional

import functools

import torch
import torch.distributed as dist

from grpo_mega.bridge import lora
from grpo_mega.config import ModelConfig
from grpo_mega.models import hf as mapping
from grpo_mega.models import layout as mcore_layout
from grpo_mega.models.gpt import unwrap_model

__all__ = ["export_buckets", "export_adapter_buckets", "export_hf_weights", "DEFAULT_BUCKET_BYTES", "Bucket",
           "DTYPES", "nbytes"]

DEFAULT_BUCKET_BYTES = 256 * 2**20
Bucket = list  # list[tuple[str, torch.Tensor]]: HF name, full tensor


def _stage_modules(model, cfg: ModelConfig, ps, merge_lora: bool = True) -> list[list[tuple[str, torch.Tensor]]]:
    """This stage's parameters as [(canonical name, local tensor)] per megatron module,
    in model order. The last stage's tied copy of the embedding is left out. LoRA
    adapter parameters are never HF tensors of their own: with ``merge_lora`` an adapted
    linear's weight is its merged local shard W + scale * B A (``bridge.lora``), else the
    frozen base weight."""
    per = cfg.num_layers // ps.pp
    model = unwrap_model(model)
    off = mcore_layout.expert_offset(model, ps)
    adapted = lora.adapted_modules(model) if merge_lora else {}
    groups: dict[str, list] = {}
    for local_name, p in model.named_parameters():
        if ".lora_A." in local_name or ".lora_B." in local_name:
            continue
        name = mcore_layout.to_global_name(local_name, ps.pp_rank, per, off)
        if name == "output_layer.weight" and cfg.tie_embeddings:
            continue
        owner = local_name[:-len(".weight")] if local_name.endswith(".weight") else None
        t = lora.merged_weight(adapted[owner]) if owner in adapted else p.detach()
        groups.setdefault(mapping.module_of(name), []).append((name, t))
    return list(groups.values())


def _gather_module(params, cfg: ModelConfig, ps) -> list[tuple[str, torch.Tensor]]:
    """TP all-gather each tensor of one module and map it to HF tensors (every TP rank
    gets them: a colocated engine needs the full tensors on every rank)."""
    out = []
    for name, local in params:
        # At TP=1 nothing is gathered: the parameter itself (export's tensors may be views),
        # where ``gather`` would copy it through a one-shard concatenation. The mapping table
        # drops megatron's vocabulary padding rows either way.
        full = local if ps.tp == 1 else mcore_layout.gather(name, local, ps.tp_group, ps.tp, cfg.vocab_size)
        out += mapping.canonical_to_hf(name, full, cfg)
    return out


def nbytes(pairs) -> int:
    return sum(t.numel() * t.element_size() for _, t in pairs)


def _is_expert_module(params) -> bool:
    return ".local_experts." in params[0][0]


def _units(modules) -> list[list]:
    """Modules grouped into what a bucket never splits: one megatron module, or every
    local expert of one MoE layer (vLLM reloads all experts of a layer as one unit and
    rebuilds the ones an update leaves out from uninitialised memory). Model order."""
    units, index = [], {}
    for params in modules:
        if _is_expert_module(params):
            layer = params[0][0].split(".mlp.experts.")[0]
            if layer in index:
                units[index[layer]].append(params)
                continue
            index[layer] = len(units)
        units.append([params])
    return units


def _stage_buckets(model, cfg: ModelConfig, ps, bucket_bytes: int, merge_lora: bool = True) -> Iterator[Bucket]:
    """This stage's HF tensors in buckets of about ``bucket_bytes`` (whole units only),
    every expert included (each MoE layer's blocks broadcast over the EP group at EP > 1).
    Every EP rank of a stage walks the same units in the same order, so the broadcasts
    pair up."""
    ep = getattr(ps, "ep", 1)

    def pairs_of(unit):
        local = [p for params in unit for p in _gather_module(params, cfg, ps)]
        if ep == 1 or not _is_expert_module(unit[0]):
            return local
        return _layer_experts(local, ps)

    yield from _pack((pairs_of(u) for u in _units(_stage_modules(model, cfg, ps, merge_lora))), bucket_bytes)


def _layer_experts(local: Bucket, ps) -> Bucket:
    """Every EP rank's experts of one MoE layer (``local``: this rank's block), the
    blocks broadcast over the EP group in turns."""
    out = []
    for owner in range(ps.ep):
        src = dist.get_global_rank(ps.ep_group, owner)
        if ps.ep_rank == owner:
            _broadcast_bucket(local, src, ps.ep_group)
            out += local
        else:
            out += _receive_bucket(src, ps.ep_group, ps.device)
    return out


def _pack(units, bucket_bytes: int) -> Iterator[Bucket]:
    """Consecutive units (lists of HF tensors) joined into buckets of about
    ``bucket_bytes``; a unit larger than that is a bucket of its own."""
    bucket, size = [], 0
    for pairs in units:
        n = nbytes(pairs)
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket += pairs
        size += n
    if bucket:
        yield bucket


def _broadcast_bucket(bucket: Optional[Bucket], src: int, group) -> None:
    header = None if bucket is None else [(n, tuple(t.shape), str(t.dtype)) for n, t in bucket]
    dist.broadcast_object_list([header], src=src, group=group)
    for _, t in bucket or ():
        dist.broadcast(t.contiguous(), src=src, group=group)


def _receive_bucket(src: int, group, device) -> Optional[Bucket]:
    box = [None]
    dist.broadcast_object_list(box, src=src, group=group)
    if box[0] is None:
        return None
    bucket = []
    for name, shape, dtype in box[0]:
        t = torch.empty(shape, dtype=DTYPES[dtype], device=device)
        dist.broadcast(t, src=src, group=group)
        bucket.append((name, t))
    return bucket


DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64,
                               torch.int8, torch.uint8, torch.int32, torch.int64)}


def export_buckets(model, model_cfg: ModelConfig, ps, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                   all_stages: bool = True, merge_lora: bool = True) -> Iterator[Bucket]:
    """Yield the model's HF tensors as buckets ``[(hf_name, full tensor), ...]``.

    Collective: every rank of the TP and PP groups must exhaust the generator.
    ``all_stages=True``: every rank receives every stage's buckets (stage 0's first),
    broadcast over the PP group one bucket at a time. ``False``: each stage yields
    only its own. Tensors may be views; do not modify them. A LoRA model's adapted
    linears export W + scale * B A (``merge_lora``; False: the base weights alone).
    """
    stage_buckets = functools.partial(_stage_buckets, model, model_cfg, ps, bucket_bytes, merge_lora)
    yield from _all_stages(stage_buckets, ps, all_stages)


def _all_stages(stage_buckets, ps, all_stages: bool = True) -> Iterator[Bucket]:
    """``stage_buckets()`` of this stage, and with ``all_stages`` every other stage's too,
    stage by stage over the PP group (step 3 of the module docstring)."""
    if ps.pp == 1 or not all_stages:
        yield from stage_buckets()
        return
    for stage in range(ps.pp):
        src = dist.get_global_rank(ps.pp_group, stage)
        if ps.pp_rank == stage:
            for bucket in stage_buckets():
                _broadcast_bucket(bucket, src, ps.pp_group)
                yield bucket
            _broadcast_bucket(None, src, ps.pp_group)  # end of this stage
        else:
            while (bucket := _receive_bucket(src, ps.pp_group, ps.device)) is not None:
                yield bucket


def export_adapter_buckets(model, model_cfg: ModelConfig, ps, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                           all_stages: bool = True) -> Iterator[Bucket]:
    """Yield a LoRA model's adapter alone in PEFT names (``bridge.lora``), in buckets;
    collective and stage by stage like ``export_buckets``."""
    yield from _all_stages(lambda: _pack(lora.adapter_hf_pairs(model, model_cfg, ps), bucket_bytes),
                           ps, all_stages)


def export_hf_weights(model, model_cfg: ModelConfig, ps, *,
                      bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for the whole model on every rank; same rules as ``export_buckets``."""
    for bucket in export_buckets(model, model_cfg, ps, bucket_bytes=bucket_bytes):
        yield from bucket
