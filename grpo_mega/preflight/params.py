"""Parameter counts of a model shape, whole and per GPU, for the memory budget.

Dense models: embedding, QKV(+bias), output projection, SwiGLU fc1 [gate; up] and fc2,
RMSNorms (QK-norms for Qwen3), untied output layer. Mixture-of-experts (``qwen3_moe``,
every layer an MoE layer, no shared expert): the MLP is a router ``[experts, h]``,
replicated like the norms, and ``num_experts`` SwiGLU experts of width
``moe_ffn_hidden_size``, split over EP (whole experts) and expert TP = ``parallel.tp``.
Everything else (attention, norms, router, embeddings) is the dense part, split over TP
and PP only. ``tests/unit/preflight/test_budget_moe.py`` ties these counts to the model
megatron-core builds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from grpo_mega.config import ModelConfig


def padded_vocab(vocab_size: int, tp: int, divisible_by: int) -> int:
    """The model builder's vocabulary padding, ``models.padded_vocab_size`` (a multiple of
    ``divisible_by * lcm(tp, 8)``), restated here because models imports torch; a test
    keeps the two equal."""
    multiple = divisible_by * math.lcm(tp, 8)
    return -(-vocab_size // multiple) * multiple


def head_dim(m: ModelConfig) -> int:
    return m.head_dim or m.hidden_size // m.num_attention_heads


@dataclass
class ParamCount:
    """Parameters of one model shape; ``*_stage`` values are per GPU of one TP rank."""

    total: int
    """Whole model, unpadded vocabulary (the number a model card quotes)."""
    per_layer_sharded: int
    """One layer's dense matrices (and QKV bias), split over TP."""
    per_layer_replicated: int
    """One layer's RMSNorm weights (and MoE router), replicated on every TP rank."""
    embedding: int
    """Padded vocabulary x hidden (split over TP)."""
    first_stage: float
    """Parameters on one GPU of the first pipeline stage (its experts included)."""
    last_stage: float
    """Parameters on one GPU of the last pipeline stage (its experts included)."""
    per_layer_experts: int = 0
    """One MoE layer's experts, whole (0 for a dense model)."""
    stage_experts: float = 0.0
    """Expert parameters on one GPU of any pipeline stage: ``layers / pp`` layers of
    ``num_experts / ep`` experts, each split over expert TP. The same on every stage."""

    experts_total: int = 0
    """All experts of the model, whole (a part of ``total``)."""

    @property
    def worst_stage(self) -> float:
        return max(self.first_stage, self.last_stage)

    @property
    def worst_stage_dense(self) -> float:
        """The worst stage's parameters outside the experts (split over TP/PP only)."""
        return self.worst_stage - self.stage_experts

    def active(self, m: ModelConfig) -> int:
        """Parameters one token runs through: ``total`` less the experts it is not routed to."""
        if not m.num_experts:
            return self.total
        return self.total - self.experts_total * (m.num_experts - m.moe_router_topk) // m.num_experts


def count_params(m: ModelConfig, tp: int, pp: int, ep: int = 1) -> ParamCount:
    """Count ``m``'s parameters, whole and on one GPU of a ``tp x pp`` layout whose experts
    are split over ``ep`` ranks (of the DP group) and over expert TP = ``tp``."""
    h, hd = m.hidden_size, head_dim(m)
    qkv_out = (m.num_attention_heads + 2 * m.num_query_groups) * hd
    sharded = h * qkv_out + (qkv_out if m.qkv_bias else 0)  # linear_qkv
    sharded += m.num_attention_heads * hd * h                # linear_proj
    replicated = 2 * h + (2 * hd if m.family in ("qwen3", "qwen3_moe") else 0)
    experts = 0
    if m.num_experts:
        replicated += m.num_experts * h                      # router, no bias
        experts = m.num_experts * 3 * h * m.moe_ffn_hidden_size  # fc1 [gate; up], fc2 each
    else:
        f = m.ffn_hidden_size
        sharded += h * 2 * f + f * h                         # fc1 [gate; up], fc2
    vpad = padded_vocab(m.vocab_size, tp, m.make_vocab_size_divisible_by)
    emb_true = m.vocab_size * h
    total = (m.num_layers * (sharded + replicated + experts) + h
             + emb_true * (1 if m.tie_embeddings else 2))

    layers = m.num_layers // pp
    stage_experts = layers * experts / (ep * tp)
    body = layers * (sharded / tp + replicated) + stage_experts
    emb = vpad * h / tp
    first = body + emb
    # The last stage holds the final norm and the output layer; a tied output layer
    # is the embedding itself at pp=1 and a copy on the last stage at pp>1.
    out = 0.0 if (m.tie_embeddings and pp == 1) else emb
    last = body + h + out
    if pp == 1:
        first = last = body + emb + h + out
    return ParamCount(total, sharded, replicated, vpad * h, first, last,
                      per_layer_experts=experts, stage_experts=stage_experts,
                      experts_total=experts * m.num_layers)
