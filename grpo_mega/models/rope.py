"""RoPE scaling: HF ``config.json`` <-> ``ModelConfig`` fields <-> megatron-core's GPTModel.

Llama-3.1/3.2/3.3 (``llama3``), YaRN-extended Qwen (``yarn``) and position-interpolated
models (``linear``) carry a ``rope_scaling`` dict (``rope_parameters`` since transformers
5). Ignoring it gives a model that loads fine and computes other logits, so every type is
either reproduced exactly or refused with an error naming the type and the file.

How each type reaches megatron-core 0.19.2 (checked against transformers'
``modeling_rope_utils``; tests/unit/models/test_rope_scaling.py compares logits):

* ``linear``: ``GPTModel(seq_len_interpolation_factor=factor)``, positions / factor.
* ``llama3``: megatron's ``RotaryEmbedding(rope_scaling=True)`` hard-codes
  low_freq_factor 1, high_freq_factor 4 and original_max_position_embeddings 8192; only the
  factor is an argument. So the model is built with plain RoPE and its ``inv_freq`` is
  replaced by ``llama3_inv_freq`` with the checkpoint's own values.
* ``yarn``: megatron's ``YarnRotaryEmbedding`` (``position_embedding_type="yarn"``), whose
  frequencies and correction range are transformers' formulas. Its attention factor
  (cos and sin of q and k times mscale) is read from ``yarn_*`` attributes of the
  TransformerConfig; megatron derives it from factor/mscale/mscale_all_dim only, so an
  explicit HF ``attention_factor`` is refused.
"""
from __future__ import annotations

import math
from typing import Mapping, Optional

import torch

from grpo_mega.config import ModelConfig
from grpo_mega.models.hf import MappingError

ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")


class RopeScalingError(MappingError):
    """An HF RoPE scaling this model cannot reproduce; the message names type and file."""


def _params(hf: Mapping, source: str) -> dict:
    # transformers lets ``rope_scaling`` win over ``rope_parameters`` (5.x's name for it)
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(params, Mapping):
        raise RopeScalingError(f"{source}: rope_scaling must be a mapping, got {params!r}")
    return dict(params)


def rope_fields_from_hf(hf: Mapping, source: str = "config.json") -> dict:
    """``ModelConfig`` keyword arguments (``rope_theta`` and the ``rope_*`` scaling fields)
    from an HF config dict; ``source`` names the file in errors."""
    p = _params(hf, source)
    rope_type = p.get("rope_type", p.get("type", "default"))
    partial = p.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise RopeScalingError(f"{source}: partial_rotary_factor={partial} is not supported "
                               "(megatron model here rotates the whole head)")
    out = {"rope_theta": float(p.get("rope_theta", hf.get("rope_theta", 10000.0)))}
    if rope_type in ("default", None):
        return out
    if rope_type not in ROPE_SCALINGS:
        raise RopeScalingError(
            f"{source}: rope_scaling type {rope_type!r} is not supported; supported: "
            f"{[t for t in ROPE_SCALINGS if t != 'none']} (HF 'default' means none)")

    def need(key):
        if p.get(key) is None:
            raise RopeScalingError(f"{source}: rope_scaling type {rope_type!r} needs {key!r}")
        return p[key]

    max_pos = int(hf.get("max_position_embeddings", 2048))
    # transformers prefers a top-level original_max_position_embeddings (Phi-3 style)
    original = int(hf.get("original_max_position_embeddings") or p.get("original_max_position_embeddings")
                   or max_pos)
    out["rope_scaling"] = rope_type
    if rope_type == "linear":
        out["rope_scaling_factor"] = float(need("factor"))
    elif rope_type == "llama3":
        out.update(rope_scaling_factor=float(need("factor")),
                   rope_low_freq_factor=float(need("low_freq_factor")),
                   rope_high_freq_factor=float(need("high_freq_factor")),
                   rope_original_max_position_embeddings=original)
        if out["rope_high_freq_factor"] <= out["rope_low_freq_factor"]:
            raise RopeScalingError(f"{source}: llama3 high_freq_factor={out['rope_high_freq_factor']} "
                                   f"must exceed low_freq_factor={out['rope_low_freq_factor']}")
    else:  # yarn
        if p.get("attention_factor") is not None:
            raise RopeScalingError(
                f"{source}: yarn attention_factor={p['attention_factor']} is not supported: "
                "megatron-core derives the YaRN attention factor from factor, mscale and "
                "mscale_all_dim only")
        factor = p.get("factor")
        out.update(rope_scaling_factor=float(factor if factor is not None else max_pos / original),
                   rope_original_max_position_embeddings=original,
                   rope_beta_fast=float(p.get("beta_fast") or 32.0),
                   rope_beta_slow=float(p.get("beta_slow") or 1.0),
                   rope_mscale=None if p.get("mscale") is None else float(p["mscale"]),
                   rope_mscale_all_dim=(None if p.get("mscale_all_dim") is None
                                        else float(p["mscale_all_dim"])),
                   rope_truncate=bool(p.get("truncate", True)))
    if out["rope_scaling_factor"] <= 0:
        raise RopeScalingError(f"{source}: rope_scaling factor={out['rope_scaling_factor']} must be > 0")
    return out


def rope_scaling_to_hf(m: ModelConfig) -> Optional[dict]:
    """The HF ``rope_scaling`` dict for ``m`` (None without scaling). transformers 4 reads it
    under this name, transformers 5 moves it into ``rope_parameters`` on load."""
    if m.rope_scaling == "none":
        return None
    if m.rope_scaling not in ROPE_SCALINGS:
        raise RopeScalingError(f"model.rope_scaling={m.rope_scaling!r}; known: {ROPE_SCALINGS}")
    out = {"rope_type": m.rope_scaling, "factor": m.rope_scaling_factor}
    original = m.rope_original_max_position_embeddings or m.max_position_embeddings
    if m.rope_scaling == "llama3":
        out.update(low_freq_factor=m.rope_low_freq_factor, high_freq_factor=m.rope_high_freq_factor,
                   original_max_position_embeddings=original)
    elif m.rope_scaling == "yarn":
        out["original_max_position_embeddings"] = original
        # Only what differs from transformers' defaults, so a converted config.json
        # reads like its source and older readers meet no unknown keys.
        for key, value, default in (("beta_fast", m.rope_beta_fast, 32.0), ("beta_slow", m.rope_beta_slow, 1.0),
                                    ("mscale", m.rope_mscale, None),
                                    ("mscale_all_dim", m.rope_mscale_all_dim, None),
                                    ("truncate", m.rope_truncate, True)):
            if value != default:
                out[key] = value
    return out


def llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float,
                    high_freq_factor: float, original_max_position_embeddings: int) -> torch.Tensor:
    """Llama-3.1 scaling of RoPE inverse frequencies. ``inv_freq: [head_dim/2]`` -> same shape.

    Wavelengths longer than original/low_freq_factor are slowed by ``factor``, shorter than
    original/high_freq_factor kept, and in between blended linearly in original/wavelength.
    """
    wavelen = 2 * math.pi / inv_freq
    blend = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blend = blend.clamp(0.0, 1.0)  # 0: fully scaled (long wavelengths), 1: untouched (short)
    return (1 - blend) * inv_freq / factor + blend * inv_freq


def gpt_model_rope_kwargs(m: ModelConfig) -> dict:
    """RoPE keyword arguments of megatron's ``GPTModel`` for ``m``."""
    kwargs = dict(position_embedding_type="rope", rotary_base=m.rope_theta)
    if m.rope_scaling == "linear":
        kwargs["seq_len_interpolation_factor"] = m.rope_scaling_factor
    elif m.rope_scaling == "yarn":
        kwargs["position_embedding_type"] = "yarn"
    return kwargs


def set_yarn_fields(config, m: ModelConfig) -> None:
    """Put the ``yarn_*`` attributes on megatron's TransformerConfig. GPTModel and attention
    read them with getattr (only MLA configs declare them), and attention multiplies q's
    and k's cos/sin by the concentration factor they imply."""
    if m.rope_scaling != "yarn":
        return
    # transformers uses mscale/mscale_all_dim only when both are non-zero, else
    # 0.1 ln(factor) + 1; megatron gives that default when either is None.
    both = bool(m.rope_mscale) and bool(m.rope_mscale_all_dim)
    fields = dict(
        yarn_rotary_scaling_factor=m.rope_scaling_factor,
        yarn_original_max_position_embeddings=(m.rope_original_max_position_embeddings
                                               or m.max_position_embeddings),
        yarn_beta_fast=m.rope_beta_fast, yarn_beta_slow=m.rope_beta_slow,
        yarn_mscale=m.rope_mscale if both else None,
        yarn_mscale_all_dim=m.rope_mscale_all_dim if both else None,
        yarn_correction_range_round_to_int=m.rope_truncate,
    )
    for k, v in fields.items():
        setattr(config, k, v)


def finish_rotary(model, m: ModelConfig) -> None:
    """After GPTModel is built: give ``llama3`` its checkpoint's frequencies (megatron's
    constructor would hard-code Llama-3.1's low/high factors and 8192 context)."""
    if m.rope_scaling != "llama3":
        return
    rotary = model.rotary_pos_emb
    rotary.inv_freq = llama3_inv_freq(
        rotary.inv_freq, m.rope_scaling_factor, m.rope_low_freq_factor, m.rope_high_freq_factor,
        m.rope_original_max_position_embeddings or m.max_position_embeddings)
    rotary.forward.cache_clear()  # megatron memoises embeddings per length
