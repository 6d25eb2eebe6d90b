"""HF ``config.json`` <-> ``ModelConfig``: the model shape a checkpoint implies, and the
minimal HF config for a model shape. Kept apart from the pure tables in ``models.hf``
because it builds the typed config."""
from __future__ import annotations

from typing import Mapping

from grpo_mega.config import ModelConfig
from grpo_mega.models import hf as hf_tables
from grpo_mega.models.hf import HF_CLASSES, HF_MODEL_TYPES, MappingError
from grpo_mega.models.rope import rope_fields_from_hf, rope_scaling_to_hf


def model_config_from_hf(hf: Mapping, source: str = "config.json", **overrides) -> ModelConfig:
    """``ModelConfig`` from an HF ``config.json`` dict (``overrides`` win); ``source`` names
    the file in errors."""
    mtype = hf.get("model_type")
    if mtype not in HF_MODEL_TYPES:
        raise MappingError(f"unknown model family: HF model_type {mtype!r} (architectures "
                           f"{hf.get('architectures')}); known: {sorted(HF_MODEL_TYPES)}")
    family = HF_MODEL_TYPES[mtype]
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
        ffn_hidden_size=int(hf["intermediate_size"]),
        qkv_bias=qkv_bias, tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        dtype="bfloat16" if dtype == "bfloat16" else "float32",
    )
    kwargs.update(rope_fields_from_hf(hf, source))
    if family == "qwen3_moe":
        kwargs.update(_moe_fields_from_hf(hf, source))
    kwargs.update(overrides)
    return ModelConfig(**kwargs)


def _moe_fields_from_hf(hf: Mapping, source: str) -> dict:
    """The MoE shape of a Qwen3-MoE config.json. Dense layers mixed in (``mlp_only_layers``,
    ``decoder_sparse_step`` > 1) are refused: the megatron model here makes every layer MoE."""
    if hf.get("mlp_only_layers") or int(hf.get("decoder_sparse_step", 1)) != 1:
        raise MappingError(f"{source}: mlp_only_layers={hf.get('mlp_only_layers')} / decoder_sparse_step="
                           f"{hf.get('decoder_sparse_step')} mix dense and MoE layers; only all-MoE "
                           "Qwen3-MoE models are supported")
    # transformers 5 writes num_local_experts (num_experts is an alias); the hub uses num_experts
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    return dict(num_experts=int(experts), moe_router_topk=int(hf["num_experts_per_tok"]),
                moe_ffn_hidden_size=int(hf["moe_intermediate_size"]),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)))


def hf_config_from_model_config(cfg: ModelConfig) -> dict:
    """A minimal HF ``config.json`` for ``cfg`` (used when no original config is at hand)."""
    hf_tables.table(cfg.family)
    out = {
        "architectures": [HF_CLASSES[cfg.family]], "model_type": cfg.family,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups, "intermediate_size": cfg.ffn_hidden_size,
        "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": cfg.dtype,
    }
    scaling = rope_scaling_to_hf(cfg)
    if scaling is not None:
        out["rope_scaling"] = scaling
    if cfg.family != "qwen2":
        out["attention_bias"] = False
        out["head_dim"] = hf_tables.head_dim_of(cfg)
    if cfg.num_experts:
        out.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.moe_router_topk,
                   moe_intermediate_size=cfg.moe_ffn_hidden_size, norm_topk_prob=cfg.norm_topk_prob,
                   decoder_sparse_step=1, mlp_only_layers=[],
                   router_aux_loss_coef=cfg.moe_aux_loss_coeff)
    return out
