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
  norms, MoE router                replicated

MoE experts (``mlp.experts.local_experts.{k}.linear_fc1/fc2``) follow the fc1/fc2 rules
over TP (expert TP = TP), and over EP each rank holds a contiguous block of experts:
local index k on EP rank r is global expert r * (num_experts / ep) + k. Canonical names
carry the global index (``expert_offset`` converts).

Transformer Engine's grouped experts (``TEGroupedMLP``, the TE spec with
``moe_grouped_gemm``) hold one tensor per local expert in one module:
``mlp.experts.linear_fc1.weight{k}``. ``to_global_name`` spells them as the sequential
experts above, so the canonical form (and every table and rule after it) is one for
both specs; each ``weight{k}`` has the shape of ``local_experts.{k}.linear_fc1.weight``.
"""
from __future__ import annotations

import re
from typing import Optional

import torch
import torch.distributed as dist

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")
_GROUPED = re.compile(r"^mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")
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


def _shift_expert(rest: str, by: int) -> str:
    return _EXPERT.sub(lambda m: f".local_experts.{int(m.group(1)) + by}.", rest, count=1)


def expert_offset(model, ps) -> int:
    """Global index of this rank's first expert (0 for a dense model or EP=1)."""
    cfg = getattr(model, "config", None)
    experts = getattr(cfg, "num_moe_experts", None) or 0
    ep = getattr(ps, "ep", 1)
    return getattr(ps, "ep_rank", 0) * (experts // ep) if experts else 0


def sequential_expert_name(rest: str) -> str:
    """A layer-relative name with TE's grouped expert tensors spelled as sequential experts:
    ``mlp.experts.linear_fc1.weight3`` -> ``mlp.experts.local_experts.3.linear_fc1.weight``;
    any other name unchanged."""
    g = _GROUPED.match(rest)
    return f"mlp.experts.local_experts.{g.group(3)}.{g.group(1)}.{g.group(2)}" if g else rest


def to_global_name(local: str, pp_rank: int, layers_per_stage: int, expert_offset: int = 0) -> str:
    """Canonical name of a local parameter (either layer spec): global layer and expert
    indices, grouped experts spelled as sequential ones."""
    m = _LAYER.match(local)
    if not m:
        return local
    rest = sequential_expert_name(m.group(2))
    rest = _shift_expert(rest, expert_offset) if expert_offset else rest
    return f"decoder.layers.{int(m.group(1)) + pp_rank * layers_per_stage}.{rest}"


def to_local_name(name: str, pp_rank: int, layers_per_stage: int, expert_offset: int = 0,
                  local_experts: int = 0) -> Optional[str]:
    """Local name on stage ``pp_rank`` (and, for an expert tensor, on the EP rank whose
    experts start at ``expert_offset``), or None if that rank does not hold it."""
    m = _LAYER.match(name)
    if not m:
        return name
    i = int(m.group(1)) - pp_rank * layers_per_stage
    if not 0 <= i < layers_per_stage:
        return None
    rest = m.group(2)
    e = _EXPERT.search(rest)
    if e is not None and local_experts:
        if not 0 <= int(e.group(1)) - expert_offset < local_experts:
            return None
        rest = _shift_expert(rest, -expert_offset)
    return f"decoder.layers.{i}.{rest}"


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
    per, off = num_layers // ps.pp, expert_offset(model, ps)
    return [to_global_name(n, ps.pp_rank, per, off) for n, _ in model.named_parameters()]


def load_canonical(model, full_sd: dict, ps, num_layers: int, vocab_size: int) -> None:
    """Copy canonical tensors into this rank's local parameters (every local one must exist)."""
    per, off = num_layers // ps.pp, expert_offset(model, ps)
    with torch.no_grad():
        for local_name, p in model.named_parameters():
            name = to_global_name(local_name, ps.pp_rank, per, off)
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
    """This stage's parameters in canonical form (TP-gathered; one stage only, and at EP > 1
    only this rank's experts, under their global indices)."""
    per, off = num_layers // ps.pp, expert_offset(model, ps)
    out = {}
    for local_name, p in model.named_parameters():
        name = to_global_name(local_name, ps.pp_rank, per, off)
        out[name] = gather(name, p.detach(), ps.tp_group, ps.tp, vocab_size)
    return out
