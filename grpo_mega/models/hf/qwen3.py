"""Qwen3 (dense): the Llama layout plus a per-head RMSNorm on q and k (megatron's
``qk_layernorm``), and no QKV bias."""
from grpo_mega.models.hf import llama
from grpo_mega.models.hf.llama import ATTN, M
from grpo_mega.models.hf.rule import Rule

FAMILY = "qwen3"
HF_MODEL_TYPE = "qwen3"
HF_CLASS = "Qwen3ForCausalLM"

RULES = llama.RULES[:6] + (
    Rule(M + "self_attention.q_layernorm.weight", (ATTN + "q_norm.weight",), "copy", ("d",),
         when="qk_norm"),
    Rule(M + "self_attention.k_layernorm.weight", (ATTN + "k_norm.weight",), "copy", ("d",),
         when="qk_norm"),
) + llama.RULES[6:]
