"""The model section of the run configuration (``model.*``): shape, family, precision.

Split out of ``grpo_mega.config`` (which re-exports it) to keep each module legible; the
same rules hold: typed fields, a docstring under each, no import of the rest of grpo_mega.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""megatron's names of the linears LoRA can adapt (the names the mapping tables use)."""


@dataclass
class LoraConfig:
    """Low-rank adapters on the actor (``model.lora``; docs/guides/lora.md). Only the adapters
    train; the base stays frozen and, with adapters off, is the KL reference."""

    rank: int = 8
    """Adapter rank r: A is [r, in], B is [out, r]."""
    alpha: float = 16.0
    """Scale numerator: the adapter adds (alpha / rank) * B A x to each adapted linear."""
    dropout: float = 0.0
    """Dropout on the adapter's input while training (0: none; keeps updates deterministic)."""
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Which linears of every layer get adapters: any of ``linear_qkv`` (attention q, k, v),
    ``linear_proj`` (attention output), ``linear_fc1`` (MLP gate and up), ``linear_fc2`` (MLP down)."""
    init: str = "kaiming"
    """How A starts (B starts at zero, so the first policy is the base model): ``kaiming``
    (uniform in +-1/sqrt(in), PEFT's default) or ``gaussian`` (normal, std 1/rank). Drawn per
    linear from ``parallel.seed`` and its global name, so every layout starts the same."""
    sync: str = "merged"
    """How the engines get the policy: ``merged`` (W + (alpha/rank) B A resharded into vLLM like a
    full sync; any engine layout) or ``adapter`` (vLLM serves the base plus a LoRA adapter, and
    each step ships only the adapter)."""


@dataclass
class ModelConfig:
    family: str = "qwen2"
    """Model family: ``llama`` or ``qwen2`` (``qwen3`` adds QK-norm; ``qwen3_moe`` is Qwen3 with
    mixture-of-experts MLPs in every layer). Picks the HF mapping table."""
    hf_checkpoint: Optional[str] = None
    """HF checkpoint directory: the rollout engine loads it, and its config.json sets the shape."""
    init_checkpoint: Optional[str] = None
    """megatron-core checkpoint (tools/convert_checkpoint.py hf-to-mcore) to initialise the
    trainer from; null loads the HF checkpoint's weights directly."""
    vocab_size: int = 32000
    """Tokenizer vocabulary size (before padding for TP)."""
    hidden_size: int = 128
    """Model width."""
    num_layers: int = 2
    """Transformer layers; must divide by ``parallel.pp``."""
    num_attention_heads: int = 4
    """Query heads; must divide by ``parallel.tp``."""
    num_query_groups: int = 2
    """Key/value heads (GQA groups); must divide by ``parallel.tp``."""
    head_dim: Optional[int] = None
    """Per-head width; default ``hidden_size // num_attention_heads``."""
    ffn_hidden_size: int = 256
    """SwiGLU intermediate size (each of gate and up)."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rope_scaling: str = "none"
    """RoPE scaling, as in HF ``config.json``'s ``rope_scaling``/``rope_parameters``: ``none``,
    ``linear`` (position interpolation: angles divided by ``rope_scaling_factor``), ``llama3``
    (Llama-3.1 per-frequency scaling) or ``yarn`` (YaRN, with its attention factor). Read from
    the checkpoint's config.json; other HF types (dynamic, longrope) are refused there."""
    rope_scaling_factor: float = 1.0
    """Context extension factor of ``rope_scaling`` (HF ``factor``)."""
    rope_original_max_position_embeddings: Optional[int] = None
    """Pre-training context length that ``llama3`` and ``yarn`` scale from (HF
    ``original_max_position_embeddings``); null means ``max_position_embeddings``."""
    rope_low_freq_factor: float = 1.0
    """``llama3``: wavelengths above original_max_position_embeddings / this are divided by the factor."""
    rope_high_freq_factor: float = 4.0
    """``llama3``: wavelengths below original_max_position_embeddings / this are kept."""
    rope_beta_fast: float = 32.0
    """``yarn``: rotations below which a dimension is interpolated (HF ``beta_fast``)."""
    rope_beta_slow: float = 1.0
    """``yarn``: rotations above which a dimension is extrapolated (HF ``beta_slow``)."""
    rope_mscale: Optional[float] = None
    """``yarn``: HF ``mscale``; used only together with ``rope_mscale_all_dim``
    (attention factor = mscale(factor, mscale) / mscale(factor, mscale_all_dim))."""
    rope_mscale_all_dim: Optional[float] = None
    """``yarn``: HF ``mscale_all_dim``; with neither set the attention factor is 0.1 ln(factor) + 1."""
    rope_truncate: bool = True
    """``yarn``: round the correction range to whole dimensions (HF ``truncate``)."""
    qkv_bias: bool = False
    """Bias on the QKV projection (Qwen2 uses one)."""
    tie_embeddings: bool = False
    """Share the input embedding with the output layer."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    max_position_embeddings: int = 2048
    """Longest sequence the model is built for."""
    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this times ``parallel.tp`` (megatron convention)."""
    dtype: str = "float32"
    """Parameter dtype: ``float32`` or ``bfloat16``."""
    transformer_impl: str = "auto"
    """Layer implementation on GPU: ``auto`` (Transformer Engine when it imports; a broken TE
    install is an error, a missing one a loud warning), ``transformer_engine`` (required) or
    ``local`` (megatron's unfused layers, as on CPU; attention keeps [b, heads, s, s] scores)."""
    fp8: str = "none"
    """FP8 training through Transformer Engine: ``none``, ``hybrid`` (E4M3 forward, E5M2
    gradients) or ``e4m3``. Needs TE and a GPU of compute capability >= 8.9; weights and
    master weights stay in ``dtype`` / fp32, only the GEMMs run in FP8."""
    fp8_recipe: str = "delayed"
    """FP8 scaling recipe: ``delayed`` (amax history), ``tensorwise`` (current scaling,
    TE >= 2.2), ``blockwise`` (TE >= 2.3; Hopper, Blackwell emulated) or ``mxfp8`` (Blackwell)."""
    fp8_amax_history_len: int = 1024
    """Delayed scaling: how many steps of amax history set each scale."""
    fp8_amax_compute_algo: str = "max"
    """Delayed scaling: ``max`` or ``most_recent`` of the amax history."""
    recompute: str = "none"
    """Activation recomputation in the policy's backward (megatron ``recompute_granularity``):
    ``none``; ``selective`` (core attention only: its [b, heads, s, s] scores and softmax are
    recomputed instead of stored; little extra compute); ``full`` (only each chunk of
    ``recompute_num_layers`` layers keeps its input; the chunk's forward runs again in the
    backward, about a third more compute). The frozen reference never recomputes."""
    recompute_num_layers: int = 1
    """``full``: layers per recomputed chunk (megatron's ``uniform`` method); must divide into
    the layers of one pipeline stage."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism with ``parallel.tp`` > 1: activations outside attention
    and the MLP (norms, residuals) are split over the sequence across the TP ranks, dividing
    their memory by tp. Needs the Transformer Engine spec, so a GPU; sequences are padded to
    a multiple of tp."""
    reference_fp8: bool = False
    """Run the frozen reference model in FP8 too (format and recipe as above); by default
    it runs in ``dtype`` (bf16) without gradients."""
    num_experts: int = 0
    """Routed experts per MoE layer (HF ``num_experts``); 0 for a dense model. Needs
    ``family: qwen3_moe``; every layer is an MoE layer (no dense/sparse interleaving)."""
    moe_router_topk: int = 2
    """Experts each token is routed to (HF ``num_experts_per_tok``)."""
    moe_ffn_hidden_size: int = 0
    """Each expert's SwiGLU intermediate size (HF ``moe_intermediate_size``); must divide by
    ``parallel.tp`` (experts are TP-sharded like the dense MLP)."""
    norm_topk_prob: bool = True
    """Renormalise the top-k routing probabilities to sum to 1 (HF ``norm_topk_prob``).
    Either way the softmax is over all experts, as in Qwen3-MoE: true is megatron's
    softmax-after-top-k (equal to softmax over all experts, then renormalised top-k); false
    is megatron's ``moe_router_pre_softmax``."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the router's load-balancing loss (Switch/GShard ``aux_loss``: num_experts
    x sum_e fraction_of_tokens_e x mean_prob_e, per micro-batch). Its gradient is added in
    megatron's backward for every micro-batch on every DP replica, not divided by their
    number (megatron's per-token-loss convention). 0 turns it off (the usual RL choice)."""
    lora: Optional[LoraConfig] = None
    """LoRA on the actor (``--model.lora.rank=8`` etc.; the fields of ``LoraConfig`` above); null trains
    every parameter. With it the reference for the KL is the same model with the adapters off,
    so no second model is built (docs/guides/lora.md)."""

    def __post_init__(self):
        # a saved config (checkpoint metadata, dataclasses.asdict) holds the section as a dict
        if isinstance(self.lora, dict):
            self.lora = LoraConfig(**self.lora)
