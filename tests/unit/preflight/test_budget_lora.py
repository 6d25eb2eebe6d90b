"""The memory budget under ``model.lora`` (``preflight/lora_budget.py``): a frozen base has no
gradients, optimizer moments or fp32 master copy, only the adapters do, and there is no
reference copy (the reference is the actor with its adapters off)."""
from __future__ import annotations

import pytest

from grpo_mega.config import load_config
from grpo_mega.preflight.budget import count_params, derive_layout, main, memory_budget
from grpo_mega.preflight.lora_budget import adapter_params

GiB = float(1 << 30)
# h 256, 4 heads of 64 (2 kv heads), ffn 512, 4 layers; TP 2 x DP 2, ZeRO-1, bf16, KL on
SHAPE = ["--model.hidden_size=256", "--model.num_layers=4", "--model.num_attention_heads=4",
         "--model.num_query_groups=2", "--model.ffn_hidden_size=512", "--model.vocab_size=1024",
         "--model.dtype=bfloat16", "--model.transformer_impl=local", "--parallel.tp=2", "--parallel.dp=2",
         "--optimizer.use_distributed_optimizer=true", "--algorithm.kl_coef=0.01"]
LORA = ["--model.lora.rank=4"]
# per layer at TP 2, rank 4: qkv A 4x256 + B (512/2)x4, proj A 4x(256/2) + B 256x4,
# fc1 A 4x256 + B (1024/2)x4, fc2 A 4x(512/2) + B 256x4 = 8704; times 4 layers
ADAPTERS = 4 * (1024 + 1024 + 512 + 1024 + 1024 + 2048 + 1024 + 1024)


def _budget(*flags):
    cfg = load_config(None, SHAPE + list(flags))
    layout = derive_layout(cfg, 4)
    return cfg, memory_budget(cfg, layout)


def test_lora_budget_drops_the_reference_and_the_base_grads_and_moments():
    """Guards against a LoRA budget that still counts the full fine-tuning rows: a reference
    copy of the weights (with LoRA the reference is the actor, adapters off), fp32 grads and
    Adam m, v + fp32 master for every frozen base parameter; or one that forgets the adapters'
    own weights, grads and state. Exact numbers for a small shape at TP 2 x DP 2 (ZeRO-1)."""
    cfg, full = _budget()
    lcfg, lora = _budget(*LORA)
    n = count_params(cfg.model, 2, 1).worst_stage
    assert adapter_params(lcfg.model, lcfg.model.lora, 2, 1) == ADAPTERS == 34816
    exact = {  # row: (full fine-tuning, LoRA) in bytes
        "policy weights": (n * 2, (n + ADAPTERS) * 2),
        "gradients": (n * 4, ADAPTERS * 4),
        "optimizer": (n * 12 / 2, ADAPTERS * 12 / 2),
        "reference weights": (n * 2, 0.0),
        "step gradients": (n * 4 / 2, ADAPTERS * 4 / 2),
    }
    for name, (f, lo) in exact.items():
        assert full.row(name) == pytest.approx(f / GiB, rel=1e-12), name
        assert lora.row(name) == pytest.approx(lo / GiB, rel=1e-12), name
    for name in ("activations", "logits", "engine weights", "KV cache"):
        assert lora.row(name) == full.row(name), name
    # what every phase holds shrinks by exactly the reference, the base's grads and moments,
    # less the adapters' own weights, grads and moments
    saved = (n * 2 + (n - ADAPTERS) * 4 + (n - ADAPTERS) * 12 / 2 - ADAPTERS * 2) / GiB
    assert full.phase("save") - lora.phase("save") == pytest.approx(saved, rel=1e-9)
    assert full.phase("update") - lora.phase("update") == pytest.approx(saved + (n - ADAPTERS) * 2 / GiB, rel=1e-9)


def test_lora_check_config_prints_the_adapter_rows(capsys):
    """Guards against ``--check-config`` (this module's CLI) printing a full fine-tuning budget
    for a LoRA config, or not saying what the LoRA rows hold."""
    assert main(SHAPE + LORA + ["--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "34816" not in out and "0.03M LoRA adapter params (rank 4, 4 linears/layer), base frozen" in out
    assert "none: the reference is the actor with its LoRA adapters off" in out
    assert "Adam state of the LoRA adapters only (12 B/param), distributed over dp=2" in out


def test_lora_budget_adapter_count_is_the_built_models():
    """Guards against the budget's adapter count drifting from what ``attach_lora`` builds
    (fused qkv/fc1 rows, GQA's kv heads, a target subset): counted against
    ``lora_parameter_count`` of a real megatron model with adapters at TP 1."""
    from grpo_mega import lora as L
    from grpo_mega.config import LoraConfig
    from grpo_mega.distributed.state import destroy_parallel, init_parallel
    from grpo_mega.models import build_model

    m = load_config(None, SHAPE + ["--parallel.tp=1"]).model
    m.num_layers, m.vocab_size = 2, 256
    try:
        ps = init_parallel(1, 1, seed=0)
        for targets in (["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"], ["linear_qkv", "linear_fc2"]):
            lora = LoraConfig(rank=3, target_modules=targets)
            model = build_model(m, ps)
            L.attach_lora(model, lora, ps, seed=0)
            assert L.lora_parameter_count(model) == adapter_params(m, lora, 1, 1), targets
    finally:
        destroy_parallel()
