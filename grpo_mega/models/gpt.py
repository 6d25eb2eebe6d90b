"""Actor and reference megatron-core GPTModels for the Llama / Qwen2 / Qwen3(-MoE) families.

Both are built from ``ModelConfig`` for this rank's pipeline stage and TP shard:
RMSNorm, SwiGLU, RoPE (configurable base; linear / llama3 / yarn scaling, see
``models.rope``), GQA, optional QKV bias, tied or
untied embeddings, vocabulary padded for TP. The Transformer Engine layer spec
is used when TE imports cleanly (and a GPU is present); otherwise the local spec.

``qwen3_moe`` replaces every MLP by megatron's MoE layer (``moe_fields``): a softmax
top-k router as in HF's Qwen3MoeTopKRouter, the alltoall token dispatcher over the EP
group, SwiGLU experts run one after another (local spec, CPU) or as one grouped GEMM
(TE spec, GPU), and the optional load-balancing loss.

Logits come out vocab-parallel (``[b, s, V_pad/tp]``); the loss never gathers
them. Padded vocabulary columns are masked with ``mask_vocab_padding`` because
megatron's padding rows would otherwise enter the softmax denominator and shift
every log-prob away from what vLLM (which has no padding) samples with.
"""
from __future__ import annotations

import functools
import logging
import math
from typing import Optional

import torch
import torch.nn.functional as F

from grpo_mega.config import ModelConfig
from grpo_mega.distributed.state import ParallelState
from grpo_mega.distributed.schedule import causal_mask
from grpo_mega.models.packing import use_packed_core_attention
from grpo_mega.models.precision import choose_te, fp8_enabled, fp8_transformer_fields
from grpo_mega.models.rope import finish_rotary, gpt_model_rope_kwargs, set_yarn_fields

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}




def unwrap_model(model):
    """The GPTModel inside megatron's DDP / Float16Module wrappers (kept in ``.module``)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Round up to a multiple of ``divisible_by * lcm(tp, 8)``.

    Megatron pads to ``divisible_by * tp``, which makes the padded embedding's
    shape depend on TP, so a distributed checkpoint saved at TP=1 would not load
    at TP=2. Using lcm(tp, 8) keeps the shape equal for every tp in 1, 2, 4, 8
    (and for Llama-3's vocab at tp=8 it is exactly megatron's own padding).
    """
    multiple = divisible_by * math.lcm(tp, 8)
    return ((vocab_size + multiple - 1) // multiple) * multiple


def head_dim(m: ModelConfig) -> int:
    return m.head_dim or m.hidden_size // m.num_attention_heads


def transformer_config(m: ModelConfig, ps: ParallelState, *, use_te: bool, fp8: bool = False,
                       train: bool = True):
    """megatron's TransformerConfig for ``m``; ``fp8`` adds the FP8 recipe fields (TE only);
    ``train`` False (a frozen reference, forward only) drops activation recomputation."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = _DTYPES[m.dtype]
    cpu = ps.device.type == "cpu"
    kwargs = dict(
        num_layers=m.num_layers, hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads, num_query_groups=m.num_query_groups,
        kv_channels=head_dim(m), ffn_hidden_size=m.ffn_hidden_size,
        tensor_model_parallel_size=ps.tp, pipeline_model_parallel_size=ps.pp,
        normalization="RMSNorm", layernorm_epsilon=m.norm_eps,
        gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=m.qkv_bias,
        qk_layernorm=(m.family in ("qwen3", "qwen3_moe")),
        hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=(dtype == torch.bfloat16),
        use_cpu_initialization=cpu,
        # Fused kernels are CUDA-only; on GPU megatron picks its own defaults.
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        # Our loss is already normalised by the global token count; stop the schedule
        # from dividing it again by num_microbatches.
        calculate_per_token_loss=True,
        deallocate_pipeline_outputs=False,
        sequence_parallel=m.sequence_parallel and ps.tp > 1,
        **recompute_fields(m, train),
    )
    kwargs.update(moe_fields(m, ps, use_te=use_te))
    if fp8 and not use_te:
        raise ValueError(f"model.fp8={m.fp8} needs the Transformer Engine layer spec, which needs TE "
                         f"and a GPU (--model.fp8=none)")
    kwargs.update(fp8_transformer_fields(m, enabled=fp8))
    config = TransformerConfig(**kwargs)
    set_yarn_fields(config, m)
    return config


def recompute_fields(m: ModelConfig, train: bool = True) -> dict:
    """TransformerConfig fields for ``model.recompute`` (none / selective / full)."""
    if not train or m.recompute == "none":
        return {}
    if m.recompute == "selective":
        return dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    return dict(recompute_granularity="full", recompute_method="uniform",
                recompute_num_layers=m.recompute_num_layers)


def moe_fields(m: ModelConfig, ps: ParallelState, *, use_te: bool) -> dict:
    """TransformerConfig fields of the MoE layer ({} for a dense model).

    Qwen3-MoE routes with softmax over all experts, top-k, then (norm_topk_prob) divides
    the k probabilities by their sum. Megatron's softmax-after-top-k (pre_softmax=False)
    is softmax over the k selected logits, which is the same number: exp(l_i) / sum_k exp(l_j)
    = p_i / sum_k p_j, and top-k of the logits picks the same experts as top-k of the
    probabilities. Without renormalisation it is megatron's pre-softmax routing.
    The router runs in fp32 as HF's does (softmax with dtype=float)."""
    if not m.num_experts:
        return {}
    return dict(
        num_moe_experts=m.num_experts, moe_router_topk=m.moe_router_topk,
        moe_ffn_hidden_size=m.moe_ffn_hidden_size,
        moe_router_score_function="softmax", moe_router_pre_softmax=not m.norm_topk_prob,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss" if m.moe_aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=m.moe_aux_loss_coeff,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=use_te,
        expert_model_parallel_size=ps.ep,
        # expert TP = TP: experts shard like the dense MLP, so layout.shard rules carry over
        expert_tensor_parallel_size=ps.tp,
    )


def allow_moe_without_sequence_parallel(model, tp: int) -> None:
    """Lift megatron's refusal to train an MoELayer at TP > 1 without sequence parallelism.

    The refusal is about speed, not correctness: without SP every TP rank holds the same
    tokens, the dispatcher gathers all TP copies to the TP-sharded experts and
    reduce-scatters the partial outputs back, so each copy gets its exact result (the
    path megatron itself runs in eval mode). The model here keeps activations
    TP-replicated everywhere (the loss and the pipeline schedule expect [s, b, h]), so
    experts do tp-fold redundant work at TP > 1 instead. Patched per instance, so the
    layer keeps its class (megatron passes ``pg_collection`` only to MoELayer itself).

    The gradient of an expert *weight* then sums over all tp copies of every token: tp
    times the true one (measured: exactly 2x at TP=2). A hook divides it by tp; input
    and router gradients are already exact."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    def forward_unchecked(layer, hidden_states, *args, **kwargs):
        training = layer.training  # the layer's own flag only: the router keeps its own
        layer.training = False
        try:
            return MoELayer.forward(layer, hidden_states, *args, **kwargs)
        finally:
            layer.training = training

    for mod in model.modules():
        if isinstance(mod, MoELayer):
            mod.forward = functools.partial(forward_unchecked, mod)
            for p in mod.experts.parameters():
                p.register_hook(functools.partial(torch.div, other=tp))


def layer_spec(m: ModelConfig, use_te: bool):
    from megatron.core.models.gpt import gpt_layer_specs as specs

    qk_norm = m.family in ("qwen3", "qwen3_moe")
    moe = dict(num_experts=m.num_experts or None, moe_grouped_gemm=bool(m.num_experts) and use_te)
    if use_te:
        spec = specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_norm, **moe)
    else:
        spec = specs.get_gpt_layer_local_spec(qk_layernorm=qk_norm, normalization="RMSNorm", **moe)
        use_packed_core_attention(spec)  # THD micro-batches (parallel.packing); else unchanged
        if m.num_experts:
            # The local spec saves pre_mlp_layernorm under TE's fused key, which a dense TE
            # layer has; the TE MoE layer keeps a real pre_mlp_layernorm (its key unchanged).
            # Drop the rename so MoE checkpoints load under either spec (CPU <-> GPU).
            keys = dict(spec.submodules.sharded_state_dict_keys_map)
            keys.pop("pre_mlp_layernorm.", None)
            spec.submodules.sharded_state_dict_keys_map = keys
    return spec


def build_model(m: ModelConfig, ps: ParallelState, *, frozen: bool = False,
                use_te: Optional[bool] = None):
    """This rank's stage of a GPTModel. ``frozen`` makes a reference model: eval mode,
    no gradients, never handed to an optimizer, FP8 only with ``model.reference_fp8``.
    ``use_te`` None follows ``model.transformer_impl`` (``precision.choose_te``)."""
    from megatron.core.models.gpt import GPTModel

    if use_te is None:
        use_te = choose_te(ps.device.type, m.transformer_impl)
    cfg = transformer_config(m, ps, use_te=use_te, fp8=fp8_enabled(m, frozen=frozen), train=not frozen)
    model = GPTModel(
        config=cfg, transformer_layer_spec=layer_spec(m, use_te),
        vocab_size=padded_vocab_size(m.vocab_size, ps.tp, m.make_vocab_size_divisible_by),
        max_sequence_length=m.max_position_embeddings,
        pre_process=ps.is_first_stage, post_process=ps.is_last_stage,
        parallel_output=True, share_embeddings_and_output_weights=m.tie_embeddings,
        **gpt_model_rope_kwargs(m),
    )
    finish_rotary(model, m)
    if m.num_experts:
        # calculate_per_token_loss makes megatron's router multiply the load-balancing loss
        # by the micro-batch's token count, expecting finalize_model_grads to divide every
        # grad by the global token count. Our loss is normalised already and nothing divides
        # afterwards: keep the router's loss as coeff x aux per micro-batch.
        from megatron.core.transformer.moe.router import Router
        for mod in model.modules():
            if isinstance(mod, Router):
                mod.calculate_per_token_loss = False
    if m.num_experts and ps.tp > 1 and not m.sequence_parallel:
        allow_moe_without_sequence_parallel(model, ps.tp)
    model.to(ps.device)
    model.grpo_vocab_size = m.vocab_size
    if frozen:
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
    return model


def sharded_state_dict(model, ps: ParallelState) -> dict:
    """megatron's sharded state dict of this rank's stage, for dist checkpointing.

    The tied embedding's copy on the last PP stage needs the DP group to get its
    replica ids right, so every caller goes through here."""
    return model.sharded_state_dict(metadata={"dp_cp_group": ps.dp_group})


def mask_vocab_padding(logits_shard: torch.Tensor, vocab_size: int, tp_rank: int) -> torch.Tensor:
    """Push padded vocabulary columns of this shard to a huge negative value.

    logits_shard: [..., V_pad/tp]. A finite value (not -inf) keeps p*log p == 0
    in entropy and KL instead of 0 * -inf = NaN.
    """
    shard = logits_shard.shape[-1]
    start = tp_rank * shard
    if start + shard <= vocab_size:
        return logits_shard
    keep = (torch.arange(start, start + shard, device=logits_shard.device) < vocab_size)
    return logits_shard.masked_fill(~keep, -1e9 if logits_shard.dtype == torch.float32 else -1e4)




def forward_logits(model, tokens: torch.Tensor, input_tensor: Optional[torch.Tensor] = None):
    """One stage's forward on ``tokens: [b, s]`` (position ids 0..s-1).

    Returns vocab-parallel logits ``[b, s, V_pad/tp]`` on the last stage and the hidden
    states ``[s, b, h]`` elsewhere. Right padding is safe under a causal mask.
    """
    b, s = tokens.shape
    pos = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
    if input_tensor is not None:
        model.set_input_tensor(input_tensor)
    return model(tokens, pos, causal_mask(s, tokens.device))


def offload(model, device: torch.device) -> None:
    """Move a frozen model's parameters (GPU <-> CPU) between uses to free GPU memory."""
    for p in model.parameters():
        p.data = p.data.to(device, non_blocking=True)
