"""The memory budget of mixture-of-experts models (``model.family: qwen3_moe``): parameter
counts tied to the model megatron-core builds at TP/PP/EP layouts, expert bytes split over
EP, expert optimizer state over expert-DP, and the Qwen3-30B-A3B scale config.

One 4-rank gloo launch builds a tiny Qwen3-MoE (no forward) at TP1/EP1, TP1/EP2, TP2/EP2
and PP2/EP2 (about 20 s of imports on 2 cores).

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/preflight/test_budget_moe.py
"""
from __future__ import annotations

import pytest

from grpo_mega.config import ModelConfig, load_config
from grpo_mega.preflight.budget import GiB, count_params, derive_layout, memory_budget, padded_vocab
from tests import REPO
from tests.distributed import run_ranks

LAYOUTS = [(1, 1, 1), (1, 1, 2), (2, 1, 2), (1, 2, 2)]  # (tp, pp, ep) at world 4
CONFIG_30B = str(REPO / "launch" / "configs" / "qwen3_30b_a3b.yaml")


def _tiny() -> ModelConfig:
    # Widths chosen so that no two terms coincide: vocab padding, router (experts x h),
    # expert fc1/fc2, QK-norms and the attention all have different sizes.
    return ModelConfig(family="qwen3_moe", vocab_size=300, hidden_size=64, num_layers=4,
                       num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96, num_experts=4,
                       moe_router_topk=2, moe_ffn_hidden_size=24, tie_embeddings=False)


def _count_built(rank: int, world: int) -> dict:
    from megatron.core import parallel_state as mpu

    from grpo_mega.distributed.state import init_parallel
    from grpo_mega.models.gpt import build_model

    out = {}
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    out["moe_saved_per_token"] = _moe_saved_bytes_per_token(build_model(_tiny(), init_parallel(1, 1, seed=1)))
    for tp, pp, ep in LAYOUTS:
        if mpu.model_parallel_is_initialized():
            mpu.destroy_model_parallel()
        ps = init_parallel(tp, pp, ep=ep, seed=1)
        model = build_model(_tiny(), ps)
        params = dict(model.named_parameters())
        experts = sum(p.numel() for n, p in params.items() if ".experts." in n)
        out[(tp, pp, ep)] = {"all": sum(p.numel() for p in params.values()), "experts": experts,
                             "pp_rank": ps.pp_rank}
    return out


def _moe_saved_bytes_per_token(model, batch: int = 2, seq: int = 64) -> float:
    """Bytes autograd keeps for the backward inside megatron's MoE layers (the router, the
    dispatcher, the experts), per token per layer: saved tensors are counted once per storage,
    leaving out the weights and the layer's input (the norm output, the budget's ``4h``)."""
    import torch
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from grpo_mega.models.gpt import forward_logits

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}
    scope = {"on": False, "input": None}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if scope["on"] and ptr not in params and ptr != scope["input"]:
            seen.setdefault(ptr, t.untyped_storage().nbytes())
        return t

    def enter(mod, args):
        scope.update(on=True, input=args[0].untyped_storage().data_ptr())

    layers = [mod for mod in model.modules() if isinstance(mod, MoELayer)]
    for mod in layers:
        mod.register_forward_pre_hook(enter)
        mod.register_forward_hook(lambda *a: scope.update(on=False))
    tokens = torch.randint(0, 300, (batch, seq), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward_logits(model, tokens)
    return sum(seen.values()) / (batch * seq * len(layers))


@pytest.fixture(scope="module")
def built() -> list[dict]:
    return run_ranks(4, _count_built, timeout=600)


def test_moe_param_count_equals_megatron_model_per_rank_and_in_total(built):
    """Guards against a budget whose MoE parameter count is not the model megatron builds:
    experts counted as a dense MLP of ``ffn_hidden_size``, the router left out, experts not
    split over EP or over expert TP, the router split over TP like a matrix, the QK-norms
    missing, or a whole-model total (what the engine holds) that is not the model.
    Per rank (worst stage and the experts alone) at TP1/EP1, TP1/EP2, TP2/EP2, PP2/EP2, and
    the total against TP1/EP1's whole model less the vocabulary padding."""
    m = _tiny()
    for tp, pp, ep in LAYOUTS:
        pc = count_params(m, tp, pp, ep)
        for rank, r in enumerate(built):
            got = r[(tp, pp, ep)]
            want = pc.first_stage if got["pp_rank"] == 0 else pc.last_stage
            assert got["all"] == want, (tp, pp, ep, rank, got, want)
            assert got["experts"] == pc.stage_experts, (tp, pp, ep, rank, got, pc.stage_experts)
        # every expert once per expert-DP replica: the ranks' experts add up to the model's
        edp = 4 // (tp * pp * ep)
        assert sum(r[(tp, pp, ep)]["experts"] for r in built) == edp * pc.experts_total
    pc = count_params(m, 1, 1, 1)
    pad = (padded_vocab(m.vocab_size, 1, m.make_vocab_size_divisible_by) - m.vocab_size) * m.hidden_size
    assert built[0][(1, 1, 1)]["all"] == pc.total + 2 * pad  # untied: embedding and output layer


def test_moe_activation_estimate_is_what_megatron_moe_layer_saves(built):
    """Guards against an MoE activation term that is not what megatron's MoE layer keeps for
    the backward: top-k left out (one expert per token), the dispatcher's permuted buffers
    left out, or the dense MLP's ``3 ffn`` counted instead. Measured with saved-tensor hooks
    on the tiny model's MoE layers at TP1/EP1 (CPU, megatron's sequential local experts,
    which keep one more ``ffn`` per routed token than a fused SwiGLU and no expert output
    before the unpermute), per token and layer; the estimate must be within 15%."""
    from grpo_mega.preflight.budget import moe_activation_elements

    m = _tiny()  # float32: one element is 4 bytes
    est = moe_activation_elements(m, 1) * 4
    assert abs(built[0]["moe_saved_per_token"] - est) < 0.15 * est, (built[0]["moe_saved_per_token"], est)


def test_qwen3_30b_a3b_param_count_is_the_published_model():
    """Guards against a scale config that is not Qwen3-30B-A3B (transformers' Qwen3MoeConfig
    with 48 layers and head_dim 128 has 30,532,122,624 parameters, 28,991,029,248 of them in
    experts; 3.35B active with 8 of 128 experts) or a count that drifts from it."""
    m = load_config(CONFIG_30B).model
    pc = count_params(m, 1, 1)
    assert pc.total == 30_532_122_624
    assert pc.experts_total == 28_991_029_248
    assert pc.active(m) == 30_532_122_624 - 28_991_029_248 * 120 // 128


def test_budget_splits_expert_bytes_over_ep_and_expert_optimizer_over_expert_dp():
    """Guards against a budget that ignores EP (every GPU charged all 128 experts of its
    stage, so a fitting EP layout reads as 40 GiB over) or shards it wrongly: at TP1 x PP2
    x DP8 a GPU holds 24 layers x 128/ep experts x 3 x 2048 x 768 expert parameters plus the
    dense rest; with a distributed optimizer (megatron's, the one allowed at EP > 1) the
    dense state shards over dp=8 and the expert state over expert-DP = dp/ep only. And
    against engine weights that follow the trainer's EP instead of vLLM's own sharding."""
    expert = 3 * 2048 * 768
    rows = {}
    for ep in (1, 2, 8):
        cfg = load_config(CONFIG_30B, [f"--parallel.ep={ep}"])
        b = memory_budget(cfg, derive_layout(cfg, 16))
        rows[ep] = b
        pc = count_params(cfg.model, 1, 2, ep)
        assert pc.stage_experts == 24 * (128 // ep) * expert
        assert b.row("policy weights") == pytest.approx(pc.worst_stage * 2 / GiB)
        assert b.row("optimizer") == pytest.approx(pc.worst_stage * 12 / GiB)  # not distributed
    # EP 8 takes 7/8 of the experts off the GPU, nothing else
    assert rows[1].row("policy weights") - rows[8].row("policy weights") == pytest.approx(
        24 * 112 * expert * 2 / GiB)
    assert rows[8].row("gradients") == pytest.approx(rows[1].row("gradients") - 24 * 112 * expert * 4 / GiB)
    assert rows[8].fits and not rows[1].fits
    # The engine's experts do not follow the trainer's EP: vLLM shards them over its TP x DP,
    # and in external_launcher mode its DP is the 2 engine replicas (16 ranks in all); an
    # engine of its own (child mode, vLLM DP 1) holds every expert on each of its 8 shards.
    total, experts = 30_532_122_624, 28_991_029_248
    assert rows[1].row("engine weights") == rows[8].row("engine weights") == pytest.approx(
        ((total - experts) / 8 + experts / 16) * 2 / GiB)
    cfg = load_config(CONFIG_30B, ["--rollout.engine_mode=child"])
    assert memory_budget(cfg, derive_layout(cfg, 16)).row("engine weights") == pytest.approx(total * 2 / 8 / GiB)
    for ep in (2, 8):
        cfg = load_config(CONFIG_30B, [f"--parallel.ep={ep}", "--optimizer.use_distributed_optimizer=true",
                                       "--optimizer.distributed_impl=megatron"])
        pc = count_params(cfg.model, 1, 2, ep)
        b = memory_budget(cfg, derive_layout(cfg, 16))
        want = (pc.worst_stage_dense / 8 + pc.stage_experts / (8 // ep)) * 12
        assert b.row("optimizer") == pytest.approx(want / GiB)


def test_moe_activations_count_routed_tokens_and_tp_copies():
    """Guards against MoE activations counted as the dense MLP's (``3 ffn / tp`` per token,
    ignoring that each token reaches top-k experts), without the dispatcher's permuted
    buffers, or divided by TP although without sequence parallelism every TP copy of a
    token reaches the TP-sharded experts. Qwen3-30B-A3B per token and layer: attention
    4h + (32 + 8) x 128 + 32 x 128, MoE 8 x (3 x 768 + 2 x 2048) + fp32 router logits and
    probabilities (2 x 128 x 4 B = 512 bf16 elements); at TP2 the MoE term's routed tokens
    double while its ffn term halves."""
    def act(*flags):
        cfg = load_config(CONFIG_30B, ["--parallel.dp=0", *flags])
        lay = derive_layout(cfg, 16)
        per_token_layer = memory_budget(cfg, lay).row("activations") * GiB / (
            2 * 3072 * (48 // lay.pp) * min(lay.pp, lay.micro_batches))
        return per_token_layer
    h = 2048
    assert act() == pytest.approx(4 * h + 40 * 128 + 32 * 128 + 8 * (3 * 768 + 2 * h) + 512)
    assert act("--parallel.tp=2", "--parallel.ep=4") == pytest.approx(
        4 * h + (40 * 128 + 32 * 128) / 2 + 16 * (3 * 768 / 2 + 2 * h) + 512)
