"""Qwen2 / Qwen2.5: the Llama layout; its QKV bias is the table's ``qkv_bias`` rule, which
is always on for Qwen2 (``model_config_from_hf`` sets it)."""
from grpo_mega.models.hf import llama

FAMILY = "qwen2"
HF_MODEL_TYPE = "qwen2"
HF_CLASS = "Qwen2ForCausalLM"

RULES = llama.RULES
