"""One mapping table per model family: megatron canonical tensors <-> Hugging Face tensors.

The weight bridge (``grpo_mega.bridge``) and the checkpoint tools
(``grpo_mega.convert``) both convert through these tables, so a mapping bug
shows up (and is fixed) in one place.

Canonical form (see ``grpo_mega.mcore_layout``): megatron parameter names with
global layer indices, unsharded, vocabulary rows = the true vocabulary.

A table is data: a tuple of ``Rule(mcore pattern, hf patterns, kind, when)``.
``{i}`` in a pattern is the global layer index. ``kind`` names the converter:

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
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Optional, Sequence, Union

import torch

from grpo_mega.config import ModelConfig

__all__ = [
    "Rule", "FAMILIES", "MappingError", "MissingTensorError", "ShapeMismatchError",
    "table", "canonical_names", "canonical_shape", "hf_names_for", "hf_names", "hf_shapes",
    "canonical_to_hf", "hf_to_canonical", "iter_canonical_from_hf", "module_of",
    "is_vocab_hf_name", "model_config_from_hf", "hf_config_from_model_config",
]


class MappingError(ValueError):
    """A tensor or config does not fit the family's mapping table."""


class MissingTensorError(MappingError, KeyError):
    """A tensor the table needs is absent; the message names it."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


class ShapeMismatchError(MappingError):
    """A tensor's shape differs from what the config implies; names both shapes."""


@dataclass(frozen=True)
class Rule:
    """One canonical tensor and the HF tensor(s) it corresponds to."""

    mcore: str
    """Canonical name pattern (``{i}``: global layer index)."""
    hf: tuple[str, ...]
    """HF name patterns, in the order the converter takes/produces them."""
    kind: str
    """Converter: ``copy``, ``vocab``, ``qkv`` or ``gate_up``."""
    shape: tuple[str, ...]
    """Canonical shape in named dims (see ``_dims``)."""
    when: Optional[str] = None
    """None (always), ``qkv_bias``, ``untied``, ``qk_norm`` or ``alias`` (export-only spelling)."""


_M, _H = "decoder.layers.{i}.", "model.layers.{i}."
_ATTN, _MLP = _H + "self_attn.", _H + "mlp."

_LLAMA = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", ("V", "h")),
    Rule(_M + "input_layernorm.weight", (_H + "input_layernorm.weight",), "copy", ("h",)),
    Rule(_M + "self_attention.linear_qkv.layer_norm_weight", (_H + "input_layernorm.weight",),
         "copy", ("h",), when="alias"),
    Rule(_M + "self_attention.linear_qkv.weight",
         (_ATTN + "q_proj.weight", _ATTN + "k_proj.weight", _ATTN + "v_proj.weight"), "qkv", ("QKV", "h")),
    Rule(_M + "self_attention.linear_qkv.bias",
         (_ATTN + "q_proj.bias", _ATTN + "k_proj.bias", _ATTN + "v_proj.bias"), "qkv", ("QKV",),
         when="qkv_bias"),
    Rule(_M + "self_attention.linear_proj.weight", (_ATTN + "o_proj.weight",), "copy", ("h", "A")),
    Rule(_M + "pre_mlp_layernorm.weight", (_H + "post_attention_layernorm.weight",), "copy", ("h",)),
    Rule(_M + "mlp.linear_fc1.layer_norm_weight", (_H + "post_attention_layernorm.weight",),
         "copy", ("h",), when="alias"),
    Rule(_M + "mlp.linear_fc1.weight", (_MLP + "gate_proj.weight", _MLP + "up_proj.weight"),
         "gate_up", ("2F", "h")),
    Rule(_M + "mlp.linear_fc2.weight", (_MLP + "down_proj.weight",), "copy", ("h", "F")),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "copy", ("h",)),
    Rule("output_layer.weight", ("lm_head.weight",), "vocab", ("V", "h"), when="untied"),
)

# Qwen2 has the Llama layout; its QKV bias comes from the ``qkv_bias`` rule (always on in Qwen2).
_QWEN2 = _LLAMA

# Qwen3: Llama layout plus per-head RMSNorm on q and k (megatron qk_layernorm), no QKV bias.
_QWEN3 = _LLAMA[:6] + (
    Rule(_M + "self_attention.q_layernorm.weight", (_ATTN + "q_norm.weight",), "copy", ("d",),
         when="qk_norm"),
    Rule(_M + "self_attention.k_layernorm.weight", (_ATTN + "k_norm.weight",), "copy", ("d",),
         when="qk_norm"),
) + _LLAMA[6:]

FAMILIES: dict[str, tuple[Rule, ...]] = {"llama": _LLAMA, "qwen2": _QWEN2, "qwen3": _QWEN3}

# HF ``model_type`` -> family
_HF_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


# --------------------------------------------------------------------------- table lookups

def table(family: str) -> tuple[Rule, ...]:
    """The family's rules; raises naming the unknown family and the known ones."""
    try:
        return FAMILIES[family]
    except KeyError:
        raise MappingError(f"unknown model family {family!r}; known families: "
                           f"{sorted(FAMILIES)} (model.family)") from None


def _active(rule: Rule, cfg: ModelConfig) -> bool:
    if rule.when is None:
        return True
    if rule.when == "qkv_bias":
        return bool(cfg.qkv_bias)
    if rule.when == "untied":
        return not cfg.tie_embeddings
    if rule.when == "qk_norm":
        return cfg.family == "qwen3"
    return False  # "alias": never part of the canonical set


def _pattern(p: str) -> re.Pattern:
    return re.compile("^" + re.escape(p).replace(r"\{i\}", r"(?P<i>\d+)") + "$")


_PATTERNS: dict[str, re.Pattern] = {}


def _match(rules: Sequence[Rule], name: str, side: str) -> Optional[tuple[Rule, Optional[int], int]]:
    """(rule, layer index or None, position in rule.hf) for a canonical or HF name."""
    for rule in rules:
        pats = (rule.mcore,) if side == "mcore" else rule.hf
        for pos, p in enumerate(pats):
            rx = _PATTERNS.get(p) or _PATTERNS.setdefault(p, _pattern(p))
            m = rx.match(name)
            if m:
                return rule, (int(m.group("i")) if "i" in rx.groupindex else None), pos
    return None


def _fill(p: str, i: Optional[int]) -> str:
    return p.replace("{i}", str(i)) if i is not None else p


def _head_dim(cfg: ModelConfig) -> int:
    return cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads


def _dims(cfg: ModelConfig) -> dict[str, int]:
    d = _head_dim(cfg)
    return {"V": cfg.vocab_size, "h": cfg.hidden_size, "d": d,
            "A": cfg.num_attention_heads * d,
            "QKV": (cfg.num_attention_heads + 2 * cfg.num_query_groups) * d,
            "F": cfg.ffn_hidden_size, "2F": 2 * cfg.ffn_hidden_size}


def _rule_for(name: str, cfg: ModelConfig) -> tuple[Rule, Optional[int]]:
    hit = _match(table(cfg.family), name, "mcore")
    if hit is None:
        raise MappingError(f"no {cfg.family} mapping rule for megatron tensor {name!r}")
    rule, i, _ = hit
    if rule.when in ("qkv_bias", "qk_norm") and not _active(rule, cfg):
        raise MappingError(f"{name} exists but the model config rules it out "
                           f"({rule.when} is off for {_config_summary(cfg)})")
    if i is not None and not 0 <= i < cfg.num_layers:
        raise MappingError(f"{name}: layer {i} is outside the model's {cfg.num_layers} layers")
    return rule, i


def canonical_names(cfg: ModelConfig) -> list[str]:
    """Every canonical tensor of the model, layer by layer (local-spec spelling)."""
    rules = [r for r in table(cfg.family) if _active(r, cfg)]
    names = [r.mcore for r in rules if "{i}" not in r.mcore and r.mcore.startswith("embedding")]
    for i in range(cfg.num_layers):
        names += [_fill(r.mcore, i) for r in rules if "{i}" in r.mcore]
    names += [r.mcore for r in rules if "{i}" not in r.mcore and not r.mcore.startswith("embedding")]
    return names


def canonical_shape(name: str, cfg: ModelConfig) -> tuple[int, ...]:
    rule, _ = _rule_for(name, cfg)
    dims = _dims(cfg)
    return tuple(dims[k] for k in rule.shape)


def hf_names_for(name: str, cfg: ModelConfig) -> list[str]:
    """HF tensors canonical ``name`` is made of ([] for a tied output layer)."""
    rule, i = _rule_for(name, cfg)
    if rule.mcore == "output_layer.weight" and cfg.tie_embeddings:
        return []
    return [_fill(p, i) for p in rule.hf]


def hf_shapes(name: str, cfg: ModelConfig) -> list[tuple[int, ...]]:
    """Shapes of ``hf_names_for(name)``, in the same order."""
    rule, _ = _rule_for(name, cfg)
    shape = canonical_shape(name, cfg)
    rest = shape[1:]
    if rule.kind == "qkv":
        d = _head_dim(cfg)
        return [(cfg.num_attention_heads * d,) + rest, (cfg.num_query_groups * d,) + rest,
                (cfg.num_query_groups * d,) + rest]
    if rule.kind == "gate_up":
        return [(shape[0] // 2,) + rest] * 2
    return [shape] if hf_names_for(name, cfg) else []


def hf_names(cfg: ModelConfig) -> list[str]:
    """Every HF tensor a checkpoint of this config holds."""
    return [h for n in canonical_names(cfg) for h in hf_names_for(n, cfg)]


def module_of(name: str) -> str:
    """The megatron module a canonical tensor belongs to. The bridge never splits a
    module over two weight updates: vLLM reprocesses a fused layer (qkv_proj = q,k,v
    weights *and* biases; gate_up_proj) only once all of its tensors arrived."""
    return name.rsplit(".", 1)[0]


def is_vocab_hf_name(hf_name: str, cfg: ModelConfig) -> bool:
    """True for the embedding / lm_head (rows are vocabulary entries)."""
    hit = _match(table(cfg.family), hf_name, "hf")
    return hit is not None and hit[0].kind == "vocab"


# --------------------------------------------------------------------------- converters

def _qkv_split(t: torch.Tensor, cfg: ModelConfig) -> list[torch.Tensor]:
    """[(q/g + 2) * g * d, *rest] grouped -> q [heads*d, *rest], k, v [groups*d, *rest]."""
    g, d = cfg.num_query_groups, _head_dim(cfg)
    per = cfg.num_attention_heads // g
    rest = tuple(t.shape[1:])
    grouped = t.reshape((g, per + 2, d) + rest)
    q = grouped[:, :per].reshape((g * per * d,) + rest)
    k = grouped[:, per].reshape((g * d,) + rest)
    v = grouped[:, per + 1].reshape((g * d,) + rest)
    return [q.contiguous(), k.contiguous(), v.contiguous()]


def _qkv_merge(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    g, d = cfg.num_query_groups, _head_dim(cfg)
    per = cfg.num_attention_heads // g
    rest = tuple(q.shape[1:])
    grouped = torch.cat([q.reshape((g, per, d) + rest), k.reshape((g, 1, d) + rest),
                         v.reshape((g, 1, d) + rest)], dim=1)
    return grouped.reshape((g * (per + 2) * d,) + rest)


def _to_hf(rule: Rule, t: torch.Tensor, cfg: ModelConfig) -> list[torch.Tensor]:
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


def _to_canonical(rule: Rule, ts: Sequence[torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    if rule.kind in ("copy", "vocab"):
        return ts[0]
    if rule.kind == "qkv":
        return _qkv_merge(ts[0], ts[1], ts[2], cfg)
    if rule.kind == "gate_up":
        return torch.cat([ts[0], ts[1]], dim=0)
    raise MappingError(f"unknown converter kind {rule.kind!r} in the {cfg.family} table")


def canonical_to_hf(name: str, tensor: torch.Tensor, model_cfg: ModelConfig
                    ) -> list[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs of one canonical tensor; [] for the tied output layer.

    ``tensor`` is the full (TP-gathered) tensor; vocabulary tensors may still
    carry megatron's padding rows. Outputs may be views of ``tensor``.
    """
    rule, i = _rule_for(name, model_cfg)
    if rule.mcore == "output_layer.weight" and model_cfg.tie_embeddings:
        return []  # HF ties lm_head to embed_tokens; the embedding is exported once
    want, got = canonical_shape(name, model_cfg), tuple(tensor.shape)
    if rule.kind == "vocab" and got[1:] == want[1:] and got[0] >= want[0]:
        got = want  # extra rows are megatron's vocabulary padding
    if got != want:
        raise ShapeMismatchError(f"{name}: tensor shape {tuple(tensor.shape)} != shape {want} "
                                 f"implied by the model config ({_config_summary(model_cfg)})")
    return list(zip([_fill(p, i) for p in rule.hf], _to_hf(rule, tensor, model_cfg)))


TensorSource = Union[Sequence[torch.Tensor], Mapping[str, torch.Tensor], Callable[[str], torch.Tensor]]


def hf_to_canonical(name: str, tensors: TensorSource, model_cfg: ModelConfig) -> torch.Tensor:
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
                                     f"from the model config ({_config_summary(model_cfg)})")
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


def iter_canonical_from_hf(get: Callable[[str], torch.Tensor], model_cfg: ModelConfig
                           ) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (canonical name, tensor) for the whole model, fetching HF tensors lazily."""
    for name in canonical_names(model_cfg):
        yield name, hf_to_canonical(name, get, model_cfg)


def _config_summary(cfg: ModelConfig) -> str:
    return (f"family={cfg.family} vocab_size={cfg.vocab_size} hidden_size={cfg.hidden_size} "
            f"heads={cfg.num_attention_heads} groups={cfg.num_query_groups} head_dim={_head_dim(cfg)} "
            f"ffn={cfg.ffn_hidden_size} layers={cfg.num_layers}")


# --------------------------------------------------------------------------- HF config.json

def _rope_theta(hf: Mapping) -> float:
    # transformers 5 moved rope_theta into rope_parameters
    if "rope_theta" in hf:
        return float(hf["rope_theta"])
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if params.get("rope_type", "default") not in ("default", None):
        raise MappingError(f"rope_type {params.get('rope_type')!r} (RoPE scaling) is not supported")
    return float(params.get("rope_theta", 10000.0))


def model_config_from_hf(hf: Mapping, **overrides) -> ModelConfig:
    """``ModelConfig`` from an HF ``config.json`` dict (``overrides`` win)."""
    mtype = hf.get("model_type")
    if mtype not in _HF_MODEL_TYPES:
        raise MappingError(f"unknown model family: HF model_type {mtype!r} (architectures "
                           f"{hf.get('architectures')}); known: {sorted(_HF_MODEL_TYPES)}")
    family = _HF_MODEL_TYPES[mtype]
    heads = int(hf["num_attention_heads"])
    head_dim = hf.get("head_dim")
    if family == "qwen2" or head_dim == hf["hidden_size"] // heads:
        head_dim = None  # derived (vLLM's Qwen2 ignores config.head_dim anyway)
    if family == "qwen2":
        qkv_bias = True
    else:
        qkv_bias = bool(hf.get("attention_bias", False))
        if qkv_bias:
            raise MappingError(f"{family} attention_bias=true also adds an o_proj bias, which the "
                               "megatron model here does not have")
    if hf.get("mlp_bias"):
        raise MappingError("mlp_bias=true is not supported (megatron model has no MLP biases)")
    if hf.get("hidden_act", "silu") != "silu":
        raise MappingError(f"hidden_act={hf.get('hidden_act')!r}; only silu (SwiGLU) is supported")
    dtype = str(hf.get("torch_dtype") or hf.get("dtype") or "float32")
    kwargs = dict(
        family=family, vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
        num_layers=int(hf["num_hidden_layers"]), num_attention_heads=heads,
        num_query_groups=int(hf.get("num_key_value_heads") or heads), head_dim=head_dim,
        ffn_hidden_size=int(hf["intermediate_size"]), rope_theta=_rope_theta(hf),
        qkv_bias=qkv_bias, tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        dtype="bfloat16" if dtype == "bfloat16" else "float32",
    )
    kwargs.update(overrides)
    return ModelConfig(**kwargs)


_HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def hf_config_from_model_config(cfg: ModelConfig) -> dict:
    """A minimal HF ``config.json`` for ``cfg`` (used when no original config is at hand)."""
    table(cfg.family)
    out = {
        "architectures": [_HF_CLASSES[cfg.family]], "model_type": cfg.family,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups, "intermediate_size": cfg.ffn_hidden_size,
        "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": cfg.dtype,
    }
    if cfg.family != "qwen2":
        out["attention_bias"] = False
        out["head_dim"] = _head_dim(cfg)
    return out
