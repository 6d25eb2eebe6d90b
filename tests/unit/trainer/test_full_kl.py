"""``kl_kind: full`` end to end: one GRPO update through ``update_policy`` and megatron's
pipeline schedule at TP=2 over gloo, with the reference model run inside the schedule on
each micro-batch, against the same update computed directly on the whole batch with
gathered, unsharded float64 logits (full-vocabulary KL written from scratch).

One launch of 2 ranks runs every check; the tests below each assert one part of it. The
same launch then runs ``test_trainable_logits.py``'s checks and ``test_packing.py``'s and
``tests/unit/lora/test_lora.py``'s TP=2, PP=2 and DP=2 ones (asserted here, so one pytest
worker makes the launch).
"""
from __future__ import annotations

import functools

import pytest
import torch

from tests.compare import max_abs_diff_all, worst
from tests.distributed import run_ranks
from tests.unit.lora.test_lora import tp1  # noqa: F401  (the fixture: TP=1 LoRA results, in-process)
from tests.unit.trainer.test_batch import PROMPTS, RESPONSES, _batch, _model_cfg

VOCAB = 50  # padded to 56 at TP=2: rank 1's shard holds padding columns
TEMP, MAX_LEN, KL_COEF = 0.8, 8, 0.5


class _GatherVocab(torch.autograd.Function):
    """[..., V/tp] shards -> [..., V] on every rank; the backward keeps this rank's slice
    (every rank computes the same loss from the gathered logits, so nothing is summed)."""

    @staticmethod
    def forward(ctx, shard, group):
        import torch.distributed as dist

        parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, shard.contiguous(), group=group)
        ctx.rank, ctx.width = dist.get_rank(group), shard.shape[-1]
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        lo = ctx.rank * ctx.width
        return grad[..., lo:lo + ctx.width].contiguous(), None


def _full_kl_rank(rank, world):
    import copy
    import weakref

    from grpo_mega.config import AlgorithmConfig, OptimizerConfig
    from grpo_mega.distributed.schedule import causal_mask
    from grpo_mega.distributed.state import init_parallel
    from grpo_mega.models import build_model
    from grpo_mega.optim.adamw import ParallelAdamW
    from grpo_mega.trainer.passes import metrics_to_floats, update_policy
    from tests.unit.algorithms.reference import ref_loss

    class Recording(ParallelAdamW):
        def step(self, reduce=True):
            self.reduce_grads()
            self.grads = [p.grad.clone() for p in self.main]
            return super().step(reduce=False)

    ps = init_parallel(2, 1, seed=11)
    model = build_model(_model_cfg(), ps)
    ref = build_model(_model_cfg(), ps, frozen=True)
    ref.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(7)  # same noise on both ranks: replicated params stay equal
    with torch.no_grad():
        for _, p in sorted(ref.named_parameters(), key=lambda kv: kv[0]):
            p.add_(p.abs().mean().clamp(min=0.02) * torch.randn(p.shape, generator=g))
    start = copy.deepcopy(model.state_dict())

    # Event log: which model ran on which tokens, and which earlier reference outputs are
    # still alive when the next reference forward starts.
    events, ref_outs = [], []

    def policy_hook(mod, args, out):
        events.append(("policy", args[0].clone()))

    def ref_hook(mod, args, out):
        alive = sum(w() is not None for w in ref_outs)
        ref_outs.append(weakref.ref(out))
        events.append(("ref", args[0].clone(), alive, out.requires_grad or torch.is_grad_enabled()))

    hooks = [model.register_forward_hook(policy_hook), ref.register_forward_hook(ref_hook)]
    algo = AlgorithmConfig(kl_coef=KL_COEF, kl_kind="full", clip_low=0.2, clip_high=0.28)
    b = _batch()
    micro = b.split(2)  # 3 micro-batches of widths 6, 7, 6
    opt = Recording(model, OptimizerConfig(lr=1e-3), ps)
    metrics = metrics_to_floats(update_policy(model, opt, micro, ps, algo, vocab_size=VOCAB,
                                              temperature=TEMP, max_len=MAX_LEN,
                                              reuse_current_as_old=True, reference=ref))
    for h in hooks:
        h.remove()
    mb_tokens = [m.tokens for m in micro]
    order = [e[0] for e in events]
    same_tokens = all(torch.equal(events[2 * i][1], t) and torch.equal(events[2 * i + 1][1], t)
                      for i, t in enumerate(mb_tokens)) if len(events) == 2 * len(micro) else False
    ref_events = [e for e in events if e[0] == "ref"]

    # Direct: whole batch, no schedule, no slicing; logits gathered to the full vocabulary
    # and every quantity in float64.
    model.load_state_dict(start)
    opt.zero_grad()
    n, s = b.tokens.shape
    pos, mask = torch.arange(s).expand(n, s), causal_mask(s, "cpu")

    def full_logits(m, grad):
        with torch.set_grad_enabled(grad):
            shard = m(b.tokens, pos, mask)
            return _GatherVocab.apply(shard, ps.tp_group)[:, :-1, :VOCAB].double() / TEMP

    logp_all = torch.log_softmax(full_logits(model, True), -1)
    logq_all = torch.log_softmax(full_logits(ref, False), -1)
    logp = logp_all.gather(-1, b.targets.unsqueeze(-1)).squeeze(-1)
    kl64 = (logp_all.exp() * (logp_all - logq_all)).sum(-1)
    kw = dict(clip_low=0.2, clip_high=0.28, dual_clip=None, kl_coef=KL_COEF, tis_cap=None,
              mode=algo.loss_agg, max_len=MAX_LEN)
    loss64 = ref_loss(logp, logp.detach(), b.advantages.double(), b.loss_mask, None, None,
                      kl_kind="full", kl_full=kl64, **kw)
    pg64 = ref_loss(logp, logp.detach(), b.advantages.double(), b.loss_mask, None, None,
                    kl_kind="full", kl_full=torch.zeros_like(kl64), **kw)
    pg_grads = torch.autograd.grad(pg64, [p for p in model.parameters()], retain_graph=True,
                                   allow_unused=True)
    loss64.backward()
    opt.reduce_grads()
    scale = worst(float(r.abs().max()) for r in opt.grads)
    grad_diff = max_abs_diff_all([p.grad for p in opt.main], opt.grads)
    params = list(model.parameters())
    kl_share = max_abs_diff_all([p.grad for p in params],
                                [q if q is not None else torch.zeros_like(p) for p, q in zip(params, pg_grads)])
    return {"metrics": metrics, "loss64": float(loss64.detach()),
            "kl64": float(kl64[b.loss_mask].mean()), "grad_diff": grad_diff, "grad_scale": scale,
            "kl_grad_share": kl_share, "order": order, "same_tokens": same_tokens,
            "ref_alive_at_next": [e[2] for e in ref_events],
            "ref_ran_with_grad": any(e[3] for e in ref_events),
            "ref_grads_none": all(p.grad is None for p in ref.parameters())}


def _shared_rank(rank, world):
    from tests.unit.lora.test_lora import lora_rank
    from tests.unit.trainer.test_packing import packing_rank
    from tests.unit.trainer.test_trainable_logits import trainable_rank

    return {"full_kl": _full_kl_rank(rank, world), "trainable": trainable_rank(rank, world),
            "packing": packing_rank(rank, world), "lora": lora_rank(rank, world)}


@functools.lru_cache(maxsize=None)
def shared_launch():
    """One launch for this file and ``test_trainable_logits.py`` (each launch costs 10-20 s)."""
    return run_ranks(2, _shared_rank, timeout=300)


def _launch():
    return [r["full_kl"] for r in shared_launch()]


@pytest.mark.slow
def test_tp2_full_kl_update_through_schedule_matches_unsharded_fp64():
    """Guards the whole kl_kind=full path at TP=2: reference logits taken from the wrong
    micro-batch, the KL summed over one vocab shard (missing all-reduce), the wrong
    direction KL(ref || pi), padded vocab columns left in the softmax, the temperature
    applied to one policy only, or the KL gradient not reaching the policy all move the
    loss, the KL metric or the gradients away from the unsharded float64 update."""
    for r in _launch():
        assert r["metrics"]["loss"] == pytest.approx(r["loss64"], rel=1e-5, abs=1e-6), r
        assert r["metrics"]["kl"] == pytest.approx(r["kl64"], rel=1e-5, abs=1e-6), r
        assert r["kl64"] > 1e-2, "the reference must differ from the policy for the test to bite"
        # the KL term moves the gradient far more than the tolerance
        assert r["kl_grad_share"] > 100 * 1e-5 * r["grad_scale"], r
        assert r["grad_diff"] <= 1e-5 * r["grad_scale"], r


@pytest.mark.slow
def test_reference_runs_per_micro_batch_inside_the_schedule_one_shard_alive():
    """Guards the memory contract: the reference must run on each micro-batch's own tokens
    right after the policy's forward (not precomputed for the whole batch, not on another
    micro-batch's tokens), and no earlier micro-batch's reference logits may still be alive
    when the next one is computed."""
    for r in _launch():
        assert r["order"] == ["policy", "ref"] * 3, r["order"]
        assert r["same_tokens"]
        assert r["ref_alive_at_next"] == [0, 0, 0], r["ref_alive_at_next"]


@pytest.mark.slow
def test_full_kl_update_leaves_the_reference_untouched():
    """Guards against gradients flowing into the frozen reference (its forward must run
    with autograd off and build no graph). The update cannot change the reference's
    weights (they are in no optimizer), so that is not checked here: the one place that
    writes them, the iterative-GRPO reset, is tested for aliasing the policy in
    tests/unit/trainer/test_reference_reset.py."""
    for r in _launch():
        assert not r["ref_ran_with_grad"]
        assert r["ref_grads_none"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2"])
def test_packed_update_equals_padded_at_tp2_pp2_dp2_fp64(layout):
    """Guards packing (``parallel.packing``) under model and data parallelism: attention
    across a sequence boundary or RoPE not restarted on a TP shard or a later pipeline stage,
    packed hidden states mis-sized between PP stages (the reference's travel with them), a
    pad token in the loss, or a normaliser counted per micro-batch or per DP rank instead of
    globally: packed log-probs within 1e-12 and update gradients within 1e-10 of the padded
    path (test_packing.py, float64; at DP=2 each rank holds half the rows), in micro-batches
    of a row count and under a token budget (``parallel.max_tokens_per_micro_batch``), where
    it also guards a DP rank running a different micro-batch count (rank 0's rows fit fewer
    micro-batches than rank 1's: the count must be agreed, or MoE's all-to-alls hang)."""
    from tests.unit.trainer.test_packing import check_packed_equals_padded

    results = [r["packing"][layout] for r in shared_launch()]
    for r in results:
        check_packed_equals_padded(r)
    if layout == "dp2":
        assert [r["micro_batches"] for r in results] == [3, 3], [r["micro_batches"] for r in results]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2"])
def test_lora_update_at_tp2_pp2_dp2_equals_tp1_fp64(layout, tp1):
    """Guards LoRA's tensor-parallel math (``grpo_mega.lora``): a column-parallel A whose
    gradient is not all-reduced over TP (each rank's dA then holds only its rows' part), a
    row-parallel input not reduced before B (each rank adds B of a partial sum), an A drawn per
    rank, and PP/DP losing adapter gradients: log-probs, adapters on and off, and every adapter
    gradient (gathered to full tensors, summed over DP) must equal TP=1's within 1e-10, for the
    exact KL against the adapters-off reference and for k3 (tests/unit/lora/test_lora.py)."""
    from tests.unit.lora.test_lora import check_lora_layout

    check_lora_layout(layout, [r["lora"][layout] for r in shared_launch()], tp1)
