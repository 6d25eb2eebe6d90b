"""Tests for grpo_mega.algorithms.loss: aggregation modes, global batch counts,
micro-batch splits, and policy_loss edge cases (clip-higher, dual-clip, TIS,
empty responses, all-masked batches), hand-worked or against fp64 references.
The multi-rank DP checks of the loss share the launch in test_vocab_parallel.py.
"""
from __future__ import annotations

import math

import pytest
import torch

from grpo_mega.algorithms import aggregate, global_batch_counts, policy_loss
from tests.unit.algorithms.reference import FP32, LOSS_KW, MAX_LEN, MODES, batch_case, ref_loss, split_loss


# ---------------------------------------------------------------------------
# global normalisation, in-process
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_four_microbatches_equal_one_batch(mode):
    """Guards against averaging micro-batch means (wrong when token counts differ
    between micro-batches) instead of dividing each by the global count."""
    c = batch_case()
    whole = c["logp"].clone().requires_grad_()
    loss1 = split_loss(whole, c, mode, [slice(None)], None)
    loss1.backward()
    split = c["logp"].clone().requires_grad_()
    loss4 = split_loss(split, c, mode, [slice(i, i + 2) for i in range(0, 8, 2)], None)
    loss4.backward()
    torch.testing.assert_close(loss4, loss1, **FP32)
    torch.testing.assert_close(split.grad, whole.grad, **FP32)
    ref = ref_loss(c["logp"].double(), c["old_logp"].double(), c["advantages"].double(),
                    c["mask"], c["ref_logp"].double(), c["rollout_logp"].double(), mode=mode,
                    max_len=MAX_LEN, **LOSS_KW)
    torch.testing.assert_close(loss1.double(), ref, **FP32)


def test_global_batch_counts_counts_tokens_and_nonempty_seqs():
    """Guards against counting empty responses as sequences or padding as tokens."""
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    assert global_batch_counts(mask) == (3, 2)
    assert global_batch_counts([mask[:1].bool(), mask[1:].bool()]) == (3, 2)


def test_aggregate_modes_hand_worked():
    """Guards each mode's formula (DeepSeekMath seq-mean-token-mean, Dr. GRPO's
    constant max_len) and that an empty row adds to no denominator."""
    v = torch.tensor([[1.0, 2, 3], [4, 5, 6], [7, 8, 9]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]]).bool()
    expected = {"token-mean": 7 / 3, "seq-mean-token-mean": (1.5 + 4) / 2,
                "seq-mean-token-sum": 7 / 2, "seq-mean-token-sum-norm": 7 / (2 * 4)}
    for mode, want in expected.items():
        got = aggregate(v, m, mode, max_len=4)
        assert math.isclose(got.item(), want, rel_tol=1e-6), (mode, got.item(), want)
    assert aggregate(v, m, "token-mean", global_tokens=14).item() == pytest.approx(7 / 14)
    assert aggregate(v, m, "seq-mean-token-sum", global_seqs=7).item() == pytest.approx(1.0)


# ---------------------------------------------------------------------------
# policy_loss edge cases, hand-worked
# ---------------------------------------------------------------------------

def _tokens(ratios, advs):
    old = torch.zeros(1, len(ratios))
    logp = torch.log(torch.tensor([ratios])).requires_grad_()
    return logp, old, torch.tensor([advs]), torch.ones(1, len(ratios), dtype=torch.bool)


def test_clip_low_differs_from_clip_high():
    """Guards asymmetric clipping (clip-higher): ratio 1.25 with A>0 must NOT be
    clipped at clip_high=0.28, ratio 0.75 with A<0 must be clipped at clip_low=0.2."""
    logp, old, adv, mask = _tokens([1.25, 1.30, 0.75, 0.85], [1.0, 1.0, -1.0, -1.0])
    loss, m = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    loss.backward()
    assert loss.item() == pytest.approx((-1.25 - 1.28 + 0.8 + 0.85) / 4, rel=1e-6)
    # d loss / d logp = -A * ratio / N where unclipped, 0 where clipped
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.25, 0, 0, 0.85]]) / 4)
    assert m["clipfrac_high"].item() == pytest.approx(0.25)
    assert m["clipfrac_low"].item() == pytest.approx(0.25)


def test_dual_clip_bounds_negative_advantages_only():
    """Guards dual-clip: caps the loss at -A*c for A<0 (and stops its gradient),
    leaves A>0 tokens alone."""
    logp, old, adv, mask = _tokens([5.0, 2.0, 5.0], [-1.0, -1.0, 1.0])
    loss, m = policy_loss(logp, old, adv, mask, dual_clip=3.0)
    loss.backward()
    assert loss.item() == pytest.approx((3.0 + 2.0 - 1.2) / 3, rel=1e-6)
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 2.0, 0.0]]) / 3)
    assert m["dual_clipfrac"].item() == pytest.approx(1 / 3)


def test_tis_cap_truncates_importance_weights():
    """Guards truncated IS: weight = min(exp(old - rollout), cap), detached, and the
    rollout-vs-trainer gap metric."""
    logp, old, adv, mask = _tokens([1.0, 1.0], [1.0, 1.0])
    rollout = torch.tensor([[-math.log(4.0), math.log(2.0)]])   # weights 4 -> cap 2, and 0.5
    old = old.clone().requires_grad_()
    loss, m = policy_loss(logp, old, adv, mask, rollout_logp=rollout, tis_cap=2.0)
    loss.backward()
    assert loss.item() == pytest.approx((-2.0 - 0.5) / 2, rel=1e-6)
    torch.testing.assert_close(logp.grad, torch.tensor([[-2.0, -0.5]]) / 2)
    assert old.grad is None or torch.equal(old.grad, torch.zeros_like(old))
    assert m["rollout_logp_gap"].item() == pytest.approx(1.5 * math.log(2.0), rel=1e-6)
    assert m["tis_clipfrac"].item() == pytest.approx(0.5)


def test_gspo_clips_whole_sequences_hand_worked():
    """Guards GSPO's sequence-level ratio: s_i = exp(mean over the response of
    log(pi/pi_old)), one clip decision per sequence, gradient s_i * grad(logp_t)
    spread over the sequence. Catches a ratio not normalised by length (1.43
    would be clipped), a ratio clipped per token (1.3 would be), a gradient
    through the detached sequence mean (doubles it), and padding counted in the
    mean."""
    ratios = torch.tensor([[1.1, 1.3, 7.0], [0.5, 0.8, 0.9]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    logp = ratios.log().requires_grad_()
    old = torch.zeros_like(ratios)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, m = policy_loss(logp, old, adv, mask, variant="gspo", agg="seq-mean-token-mean",
                          clip_low=0.2, clip_high=0.2)
    loss.backward()
    s0, s1 = math.sqrt(1.1 * 1.3), (0.5 * 0.8 * 0.9) ** (1 / 3)   # 1.196 (inside), 0.711
    assert loss.item() == pytest.approx((-s0 + 0.8) / 2, rel=1e-12)  # seq 1 clipped at 1 - 0.2
    # d/dlogp_t of (1/2) * (-s0) = -s0 / 2 * (1/2): each of seq 0's two tokens moves
    # s0 by s0/2; seq 1 is clipped (A<0, s1 < 0.8): no gradient; padding none.
    want = torch.tensor([[-s0 / 4, -s0 / 4, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, want, rtol=1e-12, atol=1e-15)
    assert m["ratio_mean"].item() == pytest.approx((2 * s0 + 3 * s1) / 5, rel=1e-6)
    assert m["clipfrac_low"].item() == pytest.approx(3 / 5)
    # The per-token variant on the same batch clips token 1.3 and differs.
    logp2 = ratios.log().requires_grad_()
    policy_loss(logp2, old, adv, mask, variant="grpo", agg="seq-mean-token-mean")[0].backward()
    assert logp2.grad[0, 1].item() == 0.0


@pytest.mark.parametrize("mode", MODES)
def test_zero_length_response_contributes_nothing(mode):
    """Guards against NaN from 0/0 in per-sequence means and from inf/NaN
    log-probs at padded positions (0 * inf gradients), and against an empty
    response shifting any denominator."""
    c = batch_case()
    rows = c["logp"].shape[0]
    keep = [i for i in range(rows) if c["mask"][i].any()]
    assert len(keep) == rows - 1
    bad = c["logp"].clone()
    bad[~c["mask"]] = float("inf")
    bad[2] = float("nan")
    leaf = bad.requires_grad_()
    kw = dict(ref_logp=c["ref_logp"], rollout_logp=c["rollout_logp"], agg=mode, max_len=MAX_LEN,
              **LOSS_KW)
    loss, metrics = policy_loss(leaf, c["old_logp"], c["advantages"], c["mask"], **kw)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(leaf.grad).all()
    assert all(torch.isfinite(v).all() for v in metrics.values())
    assert torch.equal(leaf.grad[~c["mask"]], torch.zeros(int((~c["mask"]).sum())))
    sub = {k: v[keep] for k, v in c.items()}
    kw.update(ref_logp=sub["ref_logp"], rollout_logp=sub["rollout_logp"])
    loss_without, _ = policy_loss(sub["logp"], sub["old_logp"], sub["advantages"], sub["mask"], **kw)
    torch.testing.assert_close(loss, loss_without, **FP32)


def test_all_masked_batch_gives_zero_loss():
    """Guards against 0/0 when a micro-batch (or the global batch) has no tokens."""
    logp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    for mode in MODES:
        loss, _ = policy_loss(logp, logp.detach(), torch.ones(2), mask, agg=mode, max_len=3,
                              global_tokens=0, global_seqs=0)
        assert loss.item() == 0.0
        loss2, _ = policy_loss(logp, logp.detach(), torch.ones(2), mask, agg=mode, max_len=3)
        assert loss2.item() == 0.0


# ---------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------

_lp, _m = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
BAD_INPUTS = {
    "unknown_agg_mode": (lambda: aggregate(_lp, _m, "sum"), "mode"),
    "agg_mask_shape": (lambda: aggregate(_lp, torch.ones(3, dtype=torch.bool), "token-mean"), "mask"),
    "norm_mode_needs_max_len": (lambda: aggregate(_lp, _m, "seq-mean-token-sum-norm"), "max_len"),
    "old_logp_shape": (lambda: policy_loss(_lp, torch.zeros(2, 4), torch.zeros(2), _m), "old_logp"),
    "advantages_shape": (lambda: policy_loss(_lp, _lp, torch.zeros(3), _m), "advantages"),
    "mask_broadcast": (lambda: policy_loss(_lp, _lp, torch.zeros(2), _m[:1]), "mask"),
    "policy_unknown_agg": (lambda: policy_loss(_lp, _lp, torch.zeros(2), _m, agg="x"), "agg"),
    "policy_unknown_kl_kind": (lambda: policy_loss(_lp, _lp, torch.zeros(2), _m, kl_kind="x"),
                               "kl_kind"),
    "kl_coef_without_ref": (lambda: policy_loss(_lp, _lp, torch.zeros(2), _m, kl_coef=0.1),
                            "ref_logp"),
    "full_kl_without_kl": (lambda: policy_loss(_lp, _lp, torch.zeros(2), _m, kl_coef=0.1,
                                               kl_kind="full", ref_logp=_lp), "kl="),
    "kl_with_sample_kind": (lambda: policy_loss(_lp, _lp, torch.zeros(2), _m, kl_coef=0.1,
                                                kl_kind="k3", ref_logp=_lp, kl=_lp), "kl="),
    "full_kl_shape": (lambda: policy_loss(_lp, _lp, torch.zeros(2), _m, kl_coef=0.1,
                                          kl_kind="full", kl=torch.zeros(2, 4)), "kl"),
}


@pytest.mark.parametrize("bad", sorted(BAD_INPUTS))
def test_bad_input_raises_value_error_naming_argument(bad):
    """Guards against silent broadcasting of masks and advantages, a KL term
    without its reference, and typos in mode names silently falling back to a default."""
    fn, arg = BAD_INPUTS[bad]
    with pytest.raises(ValueError, match=arg):
        fn()
