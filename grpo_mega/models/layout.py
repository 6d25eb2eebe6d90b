"""How megatron-core lays a full (TP=1, PP=1) parameter out over TP shards and PP stages.

The *canonical* form of a model here is megatron's own parameter names with
global layer indices and unsharded tensors whose vocabulary rows are the true
vocabulary (padding removed). ``shard`` and ``gather`` convert between that and
one rank's local parameters. The HF mapping tables (``grpo_mega.models.hf``) start
from the canonical form, so these rules are written once.

Rules, by parameter:
  embedding / output_layer weight  split dim 0 over the *padded* vocabulary
  linear_qkv weight / bias         split dim 0; megatron's grouped layout keeps
                                   [q heads of a group, k, v] together per query
                                   group, so contiguous chunks are whole groups
  linear_fc1 weight                [gate; up]: each half split separately (a
                                   naive chunk would hand rank 0 all of gate)
  linear_proj / linear_fc2 weight  split dim 1
  norms                            replicated
"""
from __future__ import annotations

import re
from typing import Optional

import torch
import torch.distributed as dist

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


def split_rule(name: str) -> tuple[Optional[int], bool]:
    """(partition dim or None if replicated, is_gated_fc1)."""
    if ".layer_norm_" in name:  # TE spec: norms fused into linear_qkv / linear_fc1, replicated
        return None, False
    if name in VOCAB_PARAMS:
        return 0, False
    if name.endswith("linear_fc1.weight") or name.endswith("linear_fc1.bias"):
        return 0, True
    if ".linear_qkv." in name:
        return 0, False
    if name.endswith("linear_proj.weight") or name.endswith("linear_fc2.weight"):
        return 1, False
    return None, False


def to_global_name(local: str, pp_rank: int, layers_per_stage: int) -> str:
    m = _LAYER.match(local)
    if not m:
        return local
    return f"decoder.layers.{int(m.group(1)) + pp_rank * layers_per_stage}.{m.group(2)}"


def to_local_name(name: str, pp_rank: int, layers_per_stage: int) -> Optional[str]:
    """Local name on stage ``pp_rank``, or None if that stage does not hold ``name``'s layer."""
    m = _LAYER.match(name)
    if not m:
        return name
    i = int(m.group(1)) - pp_rank * layers_per_stage
    if 0 <= i < layers_per_stage:
        return f"decoder.layers.{i}.{m.group(2)}"
    return None


def shard(name: str, full: torch.Tensor, tp_rank: int, tp: int,
          padded_vocab: Optional[int] = None) -> torch.Tensor:
    """This TP rank's slice of canonical tensor ``full``."""
    dim, gated = split_rule(name)
    if dim is None or tp == 1 and name not in VOCAB_PARAMS:
        return full
    if name in VOCAB_PARAMS:
        if padded_vocab is None:
            raise ValueError(f"{name}: padded_vocab is required to shard vocabulary rows")
        if full.shape[0] > padded_vocab:
            raise ValueError(f"{name}: {full.shape[0]} vocabulary rows exceed padded size {padded_vocab}")
        pad = full.new_zeros((padded_vocab - full.shape[0],) + tuple(full.shape[1:]))
        full = torch.cat([full, pad], 0)
    if full.shape[dim] % (2 * tp if gated else tp):
        raise ValueError(f"{name}: dim {dim} of size {full.shape[dim]} does not split over tp={tp}")
    if gated:
        gate, up = full.chunk(2, dim)
        return torch.cat([gate.chunk(tp, dim)[tp_rank], up.chunk(tp, dim)[tp_rank]], dim)
    return full.chunk(tp, dim)[tp_rank]


def merge(name: str, shards: list[torch.Tensor], vocab_size: Optional[int] = None) -> torch.Tensor:
    """Inverse of ``shard`` given every TP rank's slice, in rank order."""
    dim, gated = split_rule(name)
    if dim is None:
        return shards[0]
    if gated:
        halves = [s.chunk(2, dim) for s in shards]
        full = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim)
    else:
        full = torch.cat(shards, dim)
    if name in VOCAB_PARAMS and vocab_size is not None:
        full = full[:vocab_size]
    return full


def gather(name: str, local: torch.Tensor, tp_group, tp: int,
           vocab_size: Optional[int] = None) -> torch.Tensor:
    """All-gather a local parameter over TP and return the canonical full tensor."""
    dim, _ = split_rule(name)
    if dim is None or tp == 1:
        return merge(name, [local], vocab_size) if dim is not None else local
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local.contiguous(), group=tp_group)
    return merge(name, parts, vocab_size)


def canonical_names(model, ps, num_layers: int) -> list[str]:
    per = num_layers // ps.pp
    return [to_global_name(n, ps.pp_rank, per) for n, _ in model.named_parameters()]


def load_canonical(model, full_sd: dict, ps, num_layers: int, vocab_size: int) -> None:
    """Copy canonical tensors into this rank's local parameters (every local one must exist)."""
    per = num_layers // ps.pp
    with torch.no_grad():
        for local_name, p in model.named_parameters():
            name = to_global_name(local_name, ps.pp_rank, per)
            if name == "output_layer.weight" and name not in full_sd:
                name = "embedding.word_embeddings.weight"  # tied copy on the last stage
            if name not in full_sd:
                raise KeyError(f"canonical state dict has no tensor for {name} (local {local_name})")
            padded = p.shape[0] * ps.tp if name in VOCAB_PARAMS else None
            t = shard(name, full_sd[name], ps.tp_rank, ps.tp, padded)
            if t.shape != p.shape:
                raise ValueError(f"{name}: shard shape {tuple(t.shape)} != parameter shape {tuple(p.shape)}")
            p.copy_(t)


def canonical_state_dict(model, ps, num_layers: int, vocab_size: int) -> dict:
    """This stage's parameters in canonical form (TP-gathered; one stage only)."""
    per = num_layers // ps.pp
    out = {}
    for local_name, p in model.named_parameters():
        name = to_global_name(local_name, ps.pp_rank, per)
        out[name] = gather(name, p.detach(), ps.tp_group, ps.tp, vocab_size)
    return out
