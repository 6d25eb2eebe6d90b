"""The model shape the trainer builds: the checkpoint's ``config.json``, not the YAML.

The trainer replaces every shape field of ``model.*`` with the HF checkpoint's before it
validates anything, because the rollout engine loads that checkpoint and the weights must
fit the model built. ``--check-config`` (``python -m grpo_mega.preflight.budget``) calls the
same function, so a config checked on a login node is validated and budgeted for the model
that will really be built (say, Qwen2.5-7B's 28 heads, not the 32 of a reused Llama YAML).

    source = model_shape_from_hf(cfg)   # "<dir>/config.json"
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from grpo_mega.config import Config, ConfigError

# The fields the checkpoint decides (rope_* are added from the dataclass): a YAML's expert
# count or width that is not the checkpoint's would build a model the weights do not load into.
SHAPE_FIELDS = ("family", "vocab_size", "hidden_size", "num_layers", "num_attention_heads",
                "num_query_groups", "head_dim", "ffn_hidden_size", "qkv_bias", "tie_embeddings",
                "norm_eps", "max_position_embeddings",
                "num_experts", "moe_router_topk", "moe_ffn_hidden_size", "norm_topk_prob")


def model_shape_from_hf(cfg: Config) -> str:
    """Fill ``cfg.model``'s shape from ``model.hf_checkpoint``'s config.json (the engine's
    truth) and return that file's path. Raises ConfigError naming the flag when it is missing."""
    from grpo_mega.models.hf_config import model_config_from_hf

    path = Path(cfg.model.hf_checkpoint)
    src = path / "config.json"
    if not src.is_file():
        raise ConfigError(f"model.hf_checkpoint={str(path)!r} has no config.json (--model.hf_checkpoint)")
    hf = model_config_from_hf(json.loads(src.read_text()), source=str(src))
    rope = [f.name for f in dataclasses.fields(hf) if f.name.startswith("rope_")]
    for f in (*SHAPE_FIELDS, *rope):
        setattr(cfg.model, f, getattr(hf, f))
    return str(src)


def describe_shape(cfg: Config) -> str:
    """One line naming the shape that was validated, e.g. for ``--check-config``."""
    m = cfg.model
    moe = f", {m.num_experts} experts top-{m.moe_router_topk}" if m.num_experts else ""
    return (f"{m.family}: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads / "
            f"{m.num_query_groups} KV groups, ffn {m.ffn_hidden_size}, vocab {m.vocab_size}{moe}")
