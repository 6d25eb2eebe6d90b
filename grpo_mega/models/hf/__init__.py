"""One mapping table per model family: megatron canonical tensors <-> Hugging Face tensors.

The weight bridge (``grpo_mega.bridge``) and the checkpoint tools
(``grpo_mega.checkpoint.convert``) both convert through these tables, so a mapping bug
shows up (and is fixed) in one place.

Canonical form (see ``grpo_mega.models.layout``): megatron parameter names with
global layer indices, unsharded, vocabulary rows = the true vocabulary.

A table is data: a tuple of ``Rule(mcore pattern, hf patterns, kind, when)``.
``{i}`` in a pattern is the global layer index, ``{e}`` the global expert index (MoE
families: megatron's ``local_experts.{e}`` is named with the *global* expert index in
canonical form; ``models.layout`` maps it to a rank's local index, and spells the Transformer
Engine spec's grouped experts ``mlp.experts.linear_fc1.weight{k}`` the same way). ``kind``
names the converter:

  copy     one tensor, unchanged
  vocab    embedding / output layer: [V(_pad), h] -> [V, h] (megatron padding rows
           are dropped on export; an HF tensor must have exactly V rows)
  qkv      megatron's grouped QKV <-> separate q, k, v (weight [.., h] or bias):
           megatron rows are per query group g: [q heads of g (q/g * d rows), k_g (d), v_g (d)]
           HF: q [heads*d, ..], k [groups*d, ..], v [groups*d, ..]
  gate_up  megatron linear_fc1 [gate; up] [2F, h] <-> gate [F, h], up [F, h]

``when`` makes a rule conditional on the config: ``qkv_bias`` (Qwen2), ``untied``
(a separate lm_head), ``alias`` (Transformer Engine spelling of a tensor the
local spec names differently: TE fuses the pre-attention / pre-MLP RMSNorm into
linear_qkv / linear_fc1 as ``layer_norm_weight``; accepted on export, never
produced on import).

    pairs = canonical_to_hf("decoder.layers.3.self_attention.linear_qkv.weight", w, cfg)
    # -> [("model.layers.3.self_attn.q_proj.weight", q), (...k...), (...v...)]
    w = hf_to_canonical("decoder.layers.3.self_attention.linear_qkv.weight", [q, k, v], cfg)
"""
from __future__ import annotations

import re
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

import torch

from grpo_mega.models.hf import llama, qwen2, qwen3, qwen3_moe
from grpo_mega.models.hf.rule import Rule

ModelShape = Any
"""Any object with ModelConfig's shape fields (family, vocab_size, hidden_size, num_layers,
num_attention_heads, num_query_groups, head_dim, ffn_hidden_size, qkv_bias, tie_embeddings;
MoE: num_experts, moe_ffn_hidden_size):
the tables import only torch, so they take the config by its attributes."""


__all__ = [
    "Rule", "FAMILIES", "MappingError", "MissingTensorError", "ShapeMismatchError",
    "table", "canonical_names", "canonical_shape", "hf_names_for", "hf_names", "hf_shapes",
    "canonical_to_hf", "hf_to_canonical", "iter_canonical_from_hf", "module_of",
    "is_vocab_hf_name", "head_dim_of", "config_summary", "HF_MODEL_TYPES", "HF_CLASSES", "ModelShape",
]


class MappingError(ValueError):
    """A tensor or config does not fit the family's mapping table."""


class MissingTensorError(MappingError, KeyError):
    """A tensor the table needs is absent; the message names it."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


class ShapeMismatchError(MappingError):
    """A tensor's shape differs from what the config implies; names both shapes."""




_MODULES = (llama, qwen2, qwen3, qwen3_moe)
FAMILIES: dict[str, tuple[Rule, ...]] = {m.FAMILY: m.RULES for m in _MODULES}
HF_MODEL_TYPES = {m.HF_MODEL_TYPE: m.FAMILY for m in _MODULES}
"""HF ``model_type`` -> family."""
HF_CLASSES = {m.FAMILY: m.HF_CLASS for m in _MODULES}
QK_NORM_FAMILIES = ("qwen3", "qwen3_moe")


# --------------------------------------------------------------------------- table lookups

def table(family: str) -> tuple[Rule, ...]:
    """The family's rules; raises naming the unknown family and the known ones."""
    try:
        return FAMILIES[family]
    except KeyError:
        raise MappingError(f"unknown model family {family!r}; known families: "
                           f"{sorted(FAMILIES)} (model.family)") from None


def _active(rule: Rule, cfg: ModelShape) -> bool:
    if rule.when is None:
        return True
    if rule.when == "qkv_bias":
        return bool(cfg.qkv_bias)
    if rule.when == "untied":
        return not cfg.tie_embeddings
    if rule.when == "qk_norm":
        return cfg.family in QK_NORM_FAMILIES
    return False  # "alias": never part of the canonical set


def _pattern(p: str) -> re.Pattern:
    rx = re.escape(p).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{e\}", r"(?P<e>\d+)")
    return re.compile("^" + rx + "$")

Index = dict
"""The placeholders a name filled in: {"i": layer, "e": expert}, each only if present."""


_PATTERNS: dict[str, re.Pattern] = {}


def _match(rules: Sequence[Rule], name: str, side: str) -> Optional[tuple[Rule, Index, int]]:
    """(rule, {"i": layer, "e": expert} as present, position in rule.hf) for a canonical
    or HF name."""
    for rule in rules:
        pats = (rule.mcore,) if side == "mcore" else rule.hf
        for pos, p in enumerate(pats):
            rx = _PATTERNS.get(p) or _PATTERNS.setdefault(p, _pattern(p))
            m = rx.match(name)
            if m:
                return rule, {k: int(v) for k, v in m.groupdict().items()}, pos
    return None


def _fill(p: str, idx: Index) -> str:
    for k, v in idx.items():
        p = p.replace("{" + k + "}", str(v))
    return p


def head_dim_of(cfg: ModelShape) -> int:
    return cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads


def _dims(cfg: ModelShape) -> dict[str, int]:
    d = head_dim_of(cfg)
    return {"V": cfg.vocab_size, "h": cfg.hidden_size, "d": d,
            "A": cfg.num_attention_heads * d,
            "QKV": (cfg.num_attention_heads + 2 * cfg.num_query_groups) * d,
            "F": cfg.ffn_hidden_size, "2F": 2 * cfg.ffn_hidden_size,
            "E": _experts(cfg), "Fe": _moe_ffn(cfg), "2Fe": 2 * _moe_ffn(cfg)}


def _experts(cfg: ModelShape) -> int:
    return int(getattr(cfg, "num_experts", 0) or 0)


def _moe_ffn(cfg: ModelShape) -> int:
    return int(getattr(cfg, "moe_ffn_hidden_size", 0) or 0)


def _rule_for(name: str, cfg: ModelShape) -> tuple[Rule, Index]:
    hit = _match(table(cfg.family), name, "mcore")
    if hit is None:
        raise MappingError(f"no {cfg.family} mapping rule for megatron tensor {name!r}")
    rule, idx, _ = hit
    i, e = idx.get("i"), idx.get("e")
    if rule.when in ("qkv_bias", "qk_norm") and not _active(rule, cfg):
        raise MappingError(f"{name} exists but the model config rules it out "
                           f"({rule.when} is off for {config_summary(cfg)})")
    if i is not None and not 0 <= i < cfg.num_layers:
        raise MappingError(f"{name}: layer {i} is outside the model's {cfg.num_layers} layers")
    if e is not None and not 0 <= e < _experts(cfg):
        raise MappingError(f"{name}: expert {e} is outside the model's {_experts(cfg)} experts "
                           f"(model.num_experts)")
    return rule, idx


def canonical_names(cfg: ModelShape) -> list[str]:
    """Every canonical tensor of the model, layer by layer, experts in order within a
    layer (local-spec spelling)."""
    rules = [r for r in table(cfg.family) if _active(r, cfg)]
    names = [r.mcore for r in rules if "{i}" not in r.mcore and r.mcore.startswith("embedding")]
    for i in range(cfg.num_layers):
        for r in rules:
            if "{i}" not in r.mcore:
                continue
            experts = range(_experts(cfg)) if "{e}" in r.mcore else (None,)
            names += [_fill(r.mcore, {"i": i} if e is None else {"i": i, "e": e}) for e in experts]
    names += [r.mcore for r in rules if "{i}" not in r.mcore and not r.mcore.startswith("embedding")]
    return names


def canonical_shape(name: str, cfg: ModelShape) -> tuple[int, ...]:
    rule, _ = _rule_for(name, cfg)
    dims = _dims(cfg)
    return tuple(dims[k] for k in rule.shape)


def hf_names_for(name: str, cfg: ModelShape) -> list[str]:
    """HF tensors canonical ``name`` is made of ([] for a tied output layer)."""
    rule, idx = _rule_for(name, cfg)
    if rule.mcore == "output_layer.weight" and cfg.tie_embeddings:
        return []
    return [_fill(p, idx) for p in rule.hf]


def hf_shapes(name: str, cfg: ModelShape) -> list[tuple[int, ...]]:
    """Shapes of ``hf_names_for(name)``, in the same order."""
    rule, _ = _rule_for(name, cfg)
    shape = canonical_shape(name, cfg)
    rest = shape[1:]
    if rule.kind == "qkv":
        d = head_dim_of(cfg)
        return [(cfg.num_attention_heads * d,) + rest, (cfg.num_query_groups * d,) + rest,
                (cfg.num_query_groups * d,) + rest]
    if rule.kind == "gate_up":
        return [(shape[0] // 2,) + rest] * 2
    return [shape] if hf_names_for(name, cfg) else []


def hf_names(cfg: ModelShape) -> list[str]:
    """Every HF tensor a checkpoint of this config holds."""
    return [h for n in canonical_names(cfg) for h in hf_names_for(n, cfg)]


def module_of(name: str) -> str:
    """The megatron module a canonical tensor belongs to. The bridge never splits a
    module over two weight updates: vLLM reprocesses a fused layer (qkv_proj = q,k,v
    weights *and* biases; gate_up_proj) only once all of its tensors arrived."""
    return name.rsplit(".", 1)[0]


def is_vocab_hf_name(hf_name: str, cfg: ModelShape) -> bool:
    """True for the embedding / lm_head (rows are vocabulary entries)."""
    hit = _match(table(cfg.family), hf_name, "hf")
    return hit is not None and hit[0].kind == "vocab"


# --------------------------------------------------------------------------- converters

def _qkv_split(t: torch.Tensor, cfg: ModelShape) -> list[torch.Tensor]:
    """[(q/g + 2) * g * d, *rest] grouped -> q [heads*d, *rest], k, v [groups*d, *rest]."""
    g, d = cfg.num_query_groups, head_dim_of(cfg)
    per = cfg.num_attention_heads // g
    rest = tuple(t.shape[1:])
    grouped = t.reshape((g, per + 2, d) + rest)
    q = grouped[:, :per].reshape((g * per * d,) + rest)
    k = grouped[:, per].reshape((g * d,) + rest)
    v = grouped[:, per + 1].reshape((g * d,) + rest)
    return [q.contiguous(), k.contiguous(), v.contiguous()]


def _qkv_merge(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelShape) -> torch.Tensor:
    g, d = cfg.num_query_groups, head_dim_of(cfg)
    per = cfg.num_attention_heads // g
    rest = tuple(q.shape[1:])
    grouped = torch.cat([q.reshape((g, per, d) + rest), k.reshape((g, 1, d) + rest),
                         v.reshape((g, 1, d) + rest)], dim=1)
    return grouped.reshape((g * (per + 2) * d,) + rest)


def _to_hf(rule: Rule, t: torch.Tensor, cfg: ModelShape) -> list[torch.Tensor]:
    if rule.kind == "copy":
        return [t]
    if rule.kind == "vocab":
        if t.shape[0] < cfg.vocab_size:
            raise ShapeMismatchError(f"{rule.mcore}: {t.shape[0]} vocabulary rows, fewer than "
                                     f"vocab_size={cfg.vocab_size}")
        return [t[:cfg.vocab_size]]  # drop megatron's padding rows
    if rule.kind == "qkv":
        return _qkv_split(t, cfg)
    if rule.kind == "gate_up":
        return list(t.chunk(2, dim=0))
    raise MappingError(f"unknown converter kind {rule.kind!r} in the {cfg.family} table")


def _to_canonical(rule: Rule, ts: Sequence[torch.Tensor], cfg: ModelShape) -> torch.Tensor:
    if rule.kind in ("copy", "vocab"):
        return ts[0]
    if rule.kind == "qkv":
        return _qkv_merge(ts[0], ts[1], ts[2], cfg)
    if rule.kind == "gate_up":
        return torch.cat([ts[0], ts[1]], dim=0)
    raise MappingError(f"unknown converter kind {rule.kind!r} in the {cfg.family} table")


def canonical_to_hf(name: str, tensor: torch.Tensor, model_cfg: ModelShape
                    ) -> list[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs of one canonical tensor; [] for the tied output layer.

    ``tensor`` is the full (TP-gathered) tensor; vocabulary tensors may still
    carry megatron's padding rows. Outputs may be views of ``tensor``.
    """
    rule, idx = _rule_for(name, model_cfg)
    if rule.mcore == "output_layer.weight" and model_cfg.tie_embeddings:
        return []  # HF ties lm_head to embed_tokens; the embedding is exported once
    want, got = canonical_shape(name, model_cfg), tuple(tensor.shape)
    if rule.kind == "vocab" and got[1:] == want[1:] and got[0] >= want[0]:
        got = want  # extra rows are megatron's vocabulary padding
    if got != want:
        raise ShapeMismatchError(f"{name}: tensor shape {tuple(tensor.shape)} != shape {want} "
                                 f"implied by the model config ({config_summary(model_cfg)})")
    return list(zip([_fill(p, idx) for p in rule.hf], _to_hf(rule, tensor, model_cfg)))


TensorSource = Union[Sequence[torch.Tensor], Mapping[str, torch.Tensor], Callable[[str], torch.Tensor]]


def hf_to_canonical(name: str, tensors: TensorSource, model_cfg: ModelShape) -> torch.Tensor:
    """Build canonical ``name`` from its HF tensors.

    ``tensors``: the tensors of ``hf_names_for(name)`` in order, or a mapping /
    getter by HF name. Every input's shape is checked against the config; a
    missing input raises ``MissingTensorError`` naming it.
    """
    names = hf_names_for(name, model_cfg)
    if not names:
        raise MappingError(f"{name} is tied to the embedding; it has no HF tensor of its own")
    rule, _ = _rule_for(name, model_cfg)
    shapes = hf_shapes(name, model_cfg)
    inputs = []
    for pos, (hf_name, want) in enumerate(zip(names, shapes)):
        t = _fetch(tensors, pos, hf_name, name)
        if tuple(t.shape) != want:
            raise ShapeMismatchError(f"{hf_name}: checkpoint shape {tuple(t.shape)} != expected {want} "
                                     f"from the model config ({config_summary(model_cfg)})")
        inputs.append(t)
    return _to_canonical(rule, inputs, model_cfg)


def _fetch(tensors: TensorSource, pos: int, hf_name: str, for_name: str) -> torch.Tensor:
    try:
        if callable(tensors) and not isinstance(tensors, Mapping):
            return tensors(hf_name)
        if isinstance(tensors, Mapping):
            return tensors[hf_name]
        return tensors[pos]
    except (KeyError, IndexError):
        raise MissingTensorError(f"checkpoint has no tensor {hf_name!r} (needed for {for_name})") from None


def iter_canonical_from_hf(get: Callable[[str], torch.Tensor], model_cfg: ModelShape
                           ) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (canonical name, tensor) for the whole model, fetching HF tensors lazily."""
    for name in canonical_names(model_cfg):
        yield name, hf_to_canonical(name, get, model_cfg)


def config_summary(cfg: ModelShape) -> str:
    return (f"family={cfg.family} vocab_size={cfg.vocab_size} hidden_size={cfg.hidden_size} "
            f"heads={cfg.num_attention_heads} groups={cfg.num_query_groups} head_dim={head_dim_of(cfg)} "
            f"ffn={cfg.ffn_hidden_size} layers={cfg.num_layers}"
            + (f" experts={_experts(cfg)} moe_ffn={_moe_ffn(cfg)}" if _experts(cfg) else ""))
