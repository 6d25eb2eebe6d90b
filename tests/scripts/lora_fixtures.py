"""LoRA helpers shared by the sync, checkpoint and export tests (and the 4-rank launch).

    cfg = lora_config(base_cfg, rank=4, alpha=8.0, sync="adapter")
    model = lora_model(cfg, ps, hf_dir)               # base from HF, adapters attached
    set_adapters(model, cfg, ps, canonical_adapters(cfg))   # known full A, B, sharded per rank
"""
from __future__ import annotations

import dataclasses
import zlib

import torch


def lora_config(cfg, **lora):
    """``cfg`` (a ModelConfig) with ``model.lora`` set (fields of ``LoraConfig``)."""
    from grpo_mega.config.model import LoraConfig

    return dataclasses.replace(cfg, lora=LoraConfig(**lora))


def adapter_params(model) -> list[tuple[str, torch.nn.Parameter]]:
    from grpo_mega.lora import lora_named_parameters

    return lora_named_parameters(model)


def lora_model(cfg, ps, hf_dir):
    """A megatron model of ``cfg`` with its base loaded from ``hf_dir`` and adapters attached
    (B = 0, as initialised)."""
    from grpo_mega.checkpoint import convert
    from grpo_mega.lora import attach_lora
    from grpo_mega.models import build_model

    model = build_model(cfg, ps)
    convert.load_hf_weights(model, hf_dir, ps, cfg)
    if not adapter_params(model):
        attach_lora(model, cfg.lora, ps)
    return model


def canonical_adapters(cfg, std: float = 0.05, seed: int = 0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Random full (A [r, in], B [out, r]) for every adapted linear of ``cfg``, keyed by the
    base weight's canonical name; seeded per name, so every rank draws the same."""
    from grpo_mega.models import hf as mapping

    out = {}
    for name in mapping.canonical_names(cfg):
        if not name.endswith(".weight") or name.rsplit(".", 2)[-2] not in cfg.lora.target_modules:
            continue
        rows, cols = mapping.canonical_shape(name, cfg)
        g = torch.Generator().manual_seed(seed * 1000003 + zlib.crc32(name.encode()))
        out[name] = (std * torch.randn(cfg.lora.rank, cols, generator=g),
                     std * torch.randn(rows, cfg.lora.rank, generator=g))
    return out


def set_adapters(model, cfg, ps, canon) -> None:
    """Copy this rank's shards of the full adapters ``canon`` into the model (A replicated and
    B row-sharded on column-parallel linears, A column-sharded and B replicated on row-parallel
    ones: the layout contract of ``grpo_mega.lora``)."""
    from grpo_mega.bridge.lora import adapted_modules
    from grpo_mega.models import layout

    per = cfg.num_layers // ps.pp
    with torch.no_grad():
        for local, m in adapted_modules(model).items():
            name = layout.to_global_name(local + ".weight", ps.pp_rank, per)
            a, b = canon[name]
            if m.lora_parallel == "column":
                b = layout.shard(name, b, ps.tp_rank, ps.tp)
            else:
                a = layout.shard(name, a, ps.tp_rank, ps.tp)
            m.lora_A.weight.copy_(a)
            m.lora_B.weight.copy_(b)


def merged_reference(hf_tensors: dict, cfg, canon) -> dict[str, torch.Tensor]:
    """The HF tensors of base + adapters merged, W + scale * B A, computed in float64 on the
    canonical tensors and mapped by the family's table (the expected merged export)."""
    from grpo_mega.models import hf as mapping

    scale = cfg.lora.alpha / cfg.lora.rank
    out = dict(hf_tensors)
    for name, (a, b) in canon.items():
        w = mapping.hf_to_canonical(name, hf_tensors, cfg).double()
        merged = (w + scale * (b.double() @ a.double())).to(torch.float32)
        out.update(mapping.canonical_to_hf(name, merged, cfg))
    return out
