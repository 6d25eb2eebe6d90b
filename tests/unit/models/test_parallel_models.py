"""TP / PP / TP2xPP2 megatron models equal the single-rank model: logits, loss, grads, clip.

One launch of 4 real gloo ranks walks through every layout (re-initialising
megatron's groups in place), because each launch costs ~10-20 s of imports.
For each model variant the reference is a TP=1/PP=1 model on the full batch,
computed in-process on every rank with the same canonical weights.
"""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from tests.compare import max_abs_diff, worst, worst_over_ranks
from tests.distributed import run_ranks

VARIANTS = {
    "qwen2_tied_bias": dict(family="qwen2", qkv_bias=True, tie_embeddings=True),
    "llama_untied": dict(family="llama", qkv_bias=False, tie_embeddings=False),
    "llama_tied": dict(family="llama", qkv_bias=False, tie_embeddings=True),
    # Per-head QK-norms: TP-replicated weights whose grads are partial per TP rank.
    "qwen3_qk_norm": dict(family="qwen3", qkv_bias=False, tie_embeddings=True),
}
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (tp, pp) at world size 4; dp = 4 / (tp * pp)
BATCH, SEQ, VOCAB = 8, 9, 300


def _model_cfg(**kw):
    from grpo_mega.config import ModelConfig
    return ModelConfig(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_attention_heads=4,
                       num_query_groups=2, ffn_hidden_size=96, rope_theta=10000.0,
                       make_vocab_size_divisible_by=16, **kw)


def _loss_fn(vocab_size, tp_rank, tp_group, total_tokens, store):
    """Mean next-token NLL over the global batch, vocab-parallel (logits never gathered)."""
    from grpo_mega.algorithms import vocab_parallel_logprobs
    from grpo_mega.models import mask_vocab_padding

    def fn(logits, mb):
        logits = mask_vocab_padding(logits, vocab_size, tp_rank)
        logp = vocab_parallel_logprobs(logits[:, :-1].float(), mb["tokens"][:, 1:], tp_group)
        nll = -logp * mb["mask"][:, 1:]
        if store is not None:
            store.append(logits.detach().clone())
        return nll.sum() / total_tokens, {"nll_sum": nll.sum().detach().clone()}
    return fn


def _check_all_layouts(rank, world_size, variant_names):
    import grpo_mega.models.layout as layout
    from megatron.core import parallel_state as mpu
    from grpo_mega.config import OptimizerConfig
    from grpo_mega.models import build_model, padded_vocab_size
    from grpo_mega.optim.adamw import ParallelAdamW
    from grpo_mega.distributed.state import init_parallel
    from grpo_mega.distributed.schedule import run_microbatches

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    tokens[:, -1] = VOCAB - 1  # a target in the last (padded) shard
    mask = torch.ones(BATCH, SEQ)
    mask[3, 5:] = 0  # ragged: padding positions must not count
    total = float(mask[:, 1:].sum())
    report = {}
    for vname in variant_names:
        mcfg = _model_cfg(**VARIANTS[vname])
        # ---------------- reference: TP=1 PP=1, whole batch, no collectives
        if mpu.model_parallel_is_initialized():
            mpu.destroy_model_parallel()
        ps = init_parallel(1, 1, seed=7)
        torch.manual_seed(1234)
        ref = build_model(mcfg, ps)
        canon = layout.canonical_state_dict(ref, ps, mcfg.num_layers, VOCAB)
        # Random non-zero biases/norms, so mistakes in them show.
        gen = torch.Generator().manual_seed(5)
        canon = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in canon.items()}
        layout.load_canonical(ref, canon, ps, mcfg.num_layers, VOCAB)
        ref_logits = []
        solo = dataclasses.replace(ps, world_size=1, dp=1, tp_group=None)
        fn = _loss_fn(VOCAB, 0, None, total, ref_logits)
        loss, _ = fn(ref(tokens, torch.arange(SEQ).expand(BATCH, SEQ),
                         torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]),
                     {"tokens": tokens, "mask": mask})
        loss.backward()
        ref_grads = {n: layout.merge(n, [p.grad.clone()], VOCAB) for n, p in zip(
            layout.canonical_names(ref, ps, mcfg.num_layers), ref.parameters())}
        if mcfg.tie_embeddings:
            ref_grads.pop("output_layer.weight", None)
        # Large eps: Adam's first step is ~lr*sign(g), which would turn 1e-9 rounding noise
        # in near-zero grads into lr-sized differences and hide what we test (the clip).
        opt_cfg = OptimizerConfig(lr=1e-2, clip_grad=0.05, eps=1e-3)
        ref_norm, ref_coef = _independent_clipped_step(ref, opt_cfg)
        ref_after = layout.canonical_state_dict(ref, ps, mcfg.num_layers, VOCAB)
        ref_logits = ref_logits[0][..., :VOCAB]
        ref_loss = float(loss.detach())

        for tp, pp in LAYOUTS:
            mpu.destroy_model_parallel()
            ps = init_parallel(tp, pp, seed=7)
            model = build_model(mcfg, ps)
            layout.load_canonical(model, canon, ps, mcfg.num_layers, VOCAB)
            # This DP replica's slice, in micro-batches of 1 or 2 sequences.
            per = BATCH // ps.dp
            rows = slice(ps.dp_rank * per, (ps.dp_rank + 1) * per)
            mbs = 1 if per <= 2 else 2
            micro = [{"tokens": tokens[rows][i:i + mbs], "mask": mask[rows][i:i + mbs]}
                     for i in range(0, per, mbs)]
            store = []
            outs = run_microbatches(model, micro, _loss_fn(VOCAB, ps.tp_rank, ps.tp_group, total, store),
                                    ps, forward_only=False)
            opt = ParallelAdamW(model, opt_cfg, ps)
            opt.reduce_grads()
            key = f"{vname} tp{tp} pp{pp}"
            res = {}
            if ps.is_last_stage:
                local = torch.cat(store, 0)
                full = layout.gather("output_layer.weight", local.transpose(0, -1).contiguous(),
                                     ps.tp_group, tp, VOCAB).transpose(0, -1)
                res["logits"] = float((full - ref_logits[rows]).abs().max())
                nll = torch.stack([o["nll_sum"] for o in outs]).sum().reshape(1)
                if ps.dp > 1:
                    torch.distributed.all_reduce(nll, group=ps.dp_group)
                res["loss"] = abs(float(nll) / total - ref_loss)
            per_stage = mcfg.num_layers // pp
            gdiffs = []
            for local_name, p in model.named_parameters():
                name = layout.to_global_name(local_name, ps.pp_rank, per_stage)
                if getattr(p, "shared", False) and pp > 1:
                    name = "embedding.word_embeddings.weight"
                g_full = layout.gather(name, p.grad, ps.tp_group, tp, VOCAB)
                gdiffs.append(max_abs_diff(g_full, ref_grads[name]))
            res["grads"] = worst(gdiffs)
            # Clip + step must give the same update at every layout.
            info = opt.step(reduce=False)
            coef = info["clip_coef"]
            res["norm_rel"] = abs(info["grad_norm"] - ref_norm) / ref_norm
            after = layout.canonical_state_dict(model, ps, mcfg.num_layers, VOCAB)
            res["update"] = worst(max_abs_diff(v, ref_after[k]) for k, v in after.items()
                                  if k in ref_after)
            res["clip_coef"] = coef
            res["coef_rel"] = abs(coef - ref_coef) / ref_coef
            report[key] = res
    return report


def _independent_clipped_step(model, opt_cfg):
    """One clipped AdamW step of the unsharded ``model`` by torch alone, sharing no code
    with ``optim/``: ``torch.nn.utils.clip_grad_norm_`` and ``torch.optim.AdamW``.
    Returns (global grad norm, clip coefficient max_norm / (norm + 1e-6), computed here)."""
    params = [p for p in model.parameters() if p.requires_grad]
    norm = float(torch.nn.utils.clip_grad_norm_(params, opt_cfg.clip_grad))
    torch.optim.AdamW(params, lr=opt_cfg.lr, betas=(opt_cfg.beta1, opt_cfg.beta2), eps=opt_cfg.eps,
                      weight_decay=opt_cfg.weight_decay).step()
    return norm, min(1.0, opt_cfg.clip_grad / (norm + 1e-6))


_max_over_ranks = worst_over_ranks


@pytest.fixture(scope="module")
def layout_results():
    return run_ranks(4, _check_all_layouts, list(VARIANTS), timeout=900)


@pytest.mark.parametrize("quantity", ["logits", "loss", "grads"])
def test_tp_pp_layouts_match_single_rank(layout_results, quantity):
    """Guards against wrong shard layouts (QKV groups, fc1 halves, vocab padding, tied
    embeddings across stages, DP splits): every layout must reproduce TP=1/PP=1."""
    merged = _max_over_ranks(layout_results, quantity)
    assert len(merged) == len(VARIANTS) * len(LAYOUTS), merged
    bad = {k: v for k, v in merged.items() if not v <= 1e-5}
    assert not bad, f"{quantity} differ from the single-rank model: {bad}"


def test_clipped_update_is_identical_at_every_layout(layout_results):
    """Guards against a grad-norm that double-counts replicated params (norms over TP,
    the tied embedding over PP, DP replicas) and a wrong clip coefficient (squared,
    inverted): at every layout the norm, the coefficient and the clipped update must equal
    those of ``torch.nn.utils.clip_grad_norm_`` + ``torch.optim.AdamW`` on the unsharded
    model (no code shared with ``optim/``)."""
    upd = _max_over_ranks(layout_results, "update")
    coef = _max_over_ranks(layout_results, "clip_coef")
    norm = _max_over_ranks(layout_results, "norm_rel")
    coef_rel = _max_over_ranks(layout_results, "coef_rel")
    assert len(upd) == len(VARIANTS) * len(LAYOUTS), upd
    assert all(v < 1e-6 for v in norm.values()), f"global grad norm differs: {norm}"
    assert all(c < 1.0 for c in coef.values()), f"clipping was not active: {coef}"
    assert all(v < 1e-6 for v in coef_rel.values()), f"clip coefficient differs from torch's: {coef_rel}"
    bad = {k: v for k, v in upd.items() if not v <= 1e-6}
    assert not bad, f"updates differ from the single-rank model: {bad}"
