"""Llama (and Llama-2/3 shaped models): megatron canonical names <-> HF names.

A table is data: ``Rule(mcore pattern, hf patterns, kind, shape, when)``; the kinds and
conditions are described in ``grpo_mega.models.hf``. Qwen2 and Qwen3 derive from it.
"""
from grpo_mega.models.hf.rule import Rule

FAMILY = "llama"
HF_MODEL_TYPE = "llama"
HF_CLASS = "LlamaForCausalLM"

M, H = "decoder.layers.{i}.", "model.layers.{i}."
ATTN, MLP = H + "self_attn.", H + "mlp."

RULES = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", ("V", "h")),
    Rule(M + "input_layernorm.weight", (H + "input_layernorm.weight",), "copy", ("h",)),
    Rule(M + "self_attention.linear_qkv.layer_norm_weight", (H + "input_layernorm.weight",),
         "copy", ("h",), when="alias"),
    Rule(M + "self_attention.linear_qkv.weight",
         (ATTN + "q_proj.weight", ATTN + "k_proj.weight", ATTN + "v_proj.weight"), "qkv", ("QKV", "h")),
    Rule(M + "self_attention.linear_qkv.bias",
         (ATTN + "q_proj.bias", ATTN + "k_proj.bias", ATTN + "v_proj.bias"), "qkv", ("QKV",),
         when="qkv_bias"),
    Rule(M + "self_attention.linear_proj.weight", (ATTN + "o_proj.weight",), "copy", ("h", "A")),
    Rule(M + "pre_mlp_layernorm.weight", (H + "post_attention_layernorm.weight",), "copy", ("h",)),
    Rule(M + "mlp.linear_fc1.layer_norm_weight", (H + "post_attention_layernorm.weight",),
         "copy", ("h",), when="alias"),
    Rule(M + "mlp.linear_fc1.weight", (MLP + "gate_proj.weight", MLP + "up_proj.weight"),
         "gate_up", ("2F", "h")),
    Rule(M + "mlp.linear_fc2.weight", (MLP + "down_proj.weight",), "copy", ("h", "F")),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "copy", ("h",)),
    Rule("output_layer.weight", ("lm_head.weight",), "vocab", ("V", "h"), when="untied"),
)
