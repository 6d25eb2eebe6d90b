"""LoRA adapters out of a megatron model: merged weights, or the adapter alone in PEFT names.

What: the two forms in which a LoRA-trained policy (``model.lora``, ``grpo_mega.lora``)
leaves the trainer.

* ``merged_weight(module, name)``: what ``export`` sends in place of an adapted linear's
  base weight (``model.lora.sync: merged``, and every HF export): the local shard
  W + scale * B A, gathered and mapped afterwards exactly like a base weight, so any engine
  layout takes it.
* ``adapter_buckets``: the adapter alone (``model.lora.sync: adapter``, the PEFT export):
  per adapted linear the full A and B (A replicated and B row-sharded on a column-parallel
  linear, A column-sharded and B replicated on a row-parallel one; the sharded one is
  all-gathered over TP with the base weight's rule, ``models.layout.gather``), named as
  Hugging Face PEFT names them: ``base_model.model.<hf module>.lora_A.weight`` [r, in] and
  ``.lora_B.weight`` [out, r]. A fused megatron linear is several HF modules: q, k and v
  (gate and up) share A, and B's rows are split by the family's mapping table, the same
  split the weight takes (``peft_pairs``). PP stages take turns as in ``export``.

Why B is split through the table and not by hand: megatron's grouped QKV rows interleave
q, k and v per query group; the table is the one place that knows it.
"""
from __future__ import annotations

import re
from typing import Iterator

import torch

from grpo_mega.config import ModelConfig
from grpo_mega.models import hf as mapping
from grpo_mega.models import layout as mcore_layout
from grpo_mega.lora import adapted_modules
from grpo_mega.models.gpt import unwrap_model

__all__ = ["PEFT_PREFIX", "adapted_modules", "peft_config", "peft_pairs", "peft_target_modules", "adapter_canonical",
           "adapter_hf_pairs", "merged_weight"]

_LAYER = re.compile(r"layers\.\d+\.")
PEFT_PREFIX = "base_model.model."
"""What PEFT puts before a wrapped causal LM's own parameter names."""


def merged_weight(module) -> torch.Tensor:
    """The local shard of W + scale * B A of an adapted linear (``grpo_mega.lora``)."""
    from grpo_mega.lora import merged_local_weight  # detached: no autograd graph is built

    return merged_local_weight(module)


_ROWS: dict = {}


def _row_maps(weight_name: str, cfg: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """(HF weight name, canonical row indices) of each HF tensor that canonical weight
    ``weight_name`` maps to: the mapping table applied to a tensor of row numbers, so B's
    rows go wherever the weight's rows go (q/k/v, gate/up, or unchanged). The indices are
    the same for every layer, so they are computed once per module kind and config."""
    key = (_LAYER.sub("layers.*.", weight_name), mapping.config_summary(cfg), cfg.qkv_bias, cfg.tie_embeddings)
    if key not in _ROWS:
        shape = mapping.canonical_shape(weight_name, cfg)
        rows = torch.arange(shape[0], dtype=torch.int64)[:, None].expand(shape[0], shape[1])
        _ROWS[key] = [t[:, 0].clone() for _, t in mapping.canonical_to_hf(weight_name, rows, cfg)]
    return list(zip(mapping.hf_names_for(weight_name, cfg), _ROWS[key]))


def peft_pairs(weight_name: str, a: torch.Tensor, b: torch.Tensor, cfg: ModelConfig
               ) -> list[tuple[str, torch.Tensor]]:
    """PEFT tensors of one adapted linear from its canonical full A [r, in] and B [out, r];
    ``weight_name`` is the base weight's canonical name (``...linear_qkv.weight``)."""
    out = []
    for hf, rows in _row_maps(weight_name, cfg):
        module = PEFT_PREFIX + hf[:-len(".weight")]
        out += [(module + ".lora_A.weight", a), (module + ".lora_B.weight", b[rows])]
    return out


def peft_target_modules(cfg: ModelConfig, target_modules) -> list[str]:
    """HF module names (``q_proj``, ...) of megatron targets (``linear_qkv``, ...), from the
    family's table."""
    names = set()
    for name in mapping.canonical_names(cfg):
        if name.endswith(".weight") and name.rsplit(".", 2)[-2] in target_modules and ".layers.0." in name:
            names |= {h.rsplit(".", 2)[-2] for h in mapping.hf_names_for(name, cfg)}
    return sorted(names)


def peft_config(cfg: ModelConfig) -> dict:
    """The ``adapter_config.json`` fields of ``cfg.lora`` (HF module names from the table)."""
    lc = cfg.lora
    return {"r": lc.rank, "lora_alpha": lc.alpha, "lora_dropout": lc.dropout,
            "target_modules": peft_target_modules(cfg, lc.target_modules),
            "base_model_name_or_path": cfg.hf_checkpoint or None}


def adapter_canonical(model, cfg: ModelConfig, ps) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """(canonical base-weight name, full A, full B) of this stage's adapted linears, in model
    order; collective over TP (the sharded factor is all-gathered)."""
    per = cfg.num_layers // ps.pp
    off = mcore_layout.expert_offset(unwrap_model(model), ps)
    for local, m in adapted_modules(model).items():
        name = mcore_layout.to_global_name(local + ".weight", ps.pp_rank, per, off)
        a, b = m.lora_A.weight.detach(), m.lora_B.weight.detach()
        if ps.tp > 1:
            # Column-parallel: B's rows are sharded like the weight's. Row-parallel: A's
            # columns are (``grpo_mega.lora``'s layout contract).
            if m.lora_parallel == "column":
                b = mcore_layout.gather(name, b, ps.tp_group, ps.tp)
            else:
                a = mcore_layout.gather(name, a, ps.tp_group, ps.tp)
        yield name, a, b


def adapter_hf_pairs(model, cfg: ModelConfig, ps) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """This stage's adapter in PEFT names, one list per adapted linear (collective over TP)."""
    for name, a, b in adapter_canonical(model, cfg, ps):
        yield peft_pairs(name, a, b, cfg)
