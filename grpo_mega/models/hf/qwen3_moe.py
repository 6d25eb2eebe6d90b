"""Qwen3-MoE: Qwen3's attention (QK-norm, no QKV bias) with a mixture-of-experts MLP in
every layer.

HF checkpoints name each expert separately (``mlp.experts.{e}.{gate,up,down}_proj``,
as ``save_pretrained`` writes them even though transformers fuses them in memory) and
the router ``mlp.gate``. megatron's local / sequential experts are
``mlp.experts.local_experts.{e}.linear_fc1`` ([gate; up], like the dense fc1) and
``linear_fc2``, and the router ``mlp.router``. ``{e}`` here is the global expert index.
The TE spec's grouped experts (``mlp.experts.linear_fc1.weight{k}``) reach this table in that
spelling (``models.layout.to_global_name``). Both specs keep a real ``pre_mlp_layernorm``
in MoE layers, so the dense table's fused ``mlp.linear_fc1.layer_norm_weight`` alias is dropped.
"""
from grpo_mega.models.hf import qwen3
from grpo_mega.models.hf.llama import MLP, M
from grpo_mega.models.hf.rule import Rule

FAMILY = "qwen3_moe"
HF_MODEL_TYPE = "qwen3_moe"
HF_CLASS = "Qwen3MoeForCausalLM"

_EXPERT, _HF_EXPERT = M + "mlp.experts.local_experts.{e}.", MLP + "experts.{e}."
_DENSE_MLP = ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight", "mlp.linear_fc1.layer_norm_weight")

RULES = tuple(r for r in qwen3.RULES if not r.mcore.endswith(_DENSE_MLP)) + (
    Rule(M + "mlp.router.weight", (MLP + "gate.weight",), "copy", ("E", "h")),
    Rule(_EXPERT + "linear_fc1.weight", (_HF_EXPERT + "gate_proj.weight", _HF_EXPERT + "up_proj.weight"),
         "gate_up", ("2Fe", "h")),
    Rule(_EXPERT + "linear_fc2.weight", (_HF_EXPERT + "down_proj.weight",), "copy", ("h", "Fe")),
)
