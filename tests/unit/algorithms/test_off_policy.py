"""The off-policy objectives (``algorithm.off_policy``) against per-token float64 references
written here from the definitions (AReaL's decoupled PPO; naive PPO on the behaviour
policy), the reduction to today's loss at ``max_staleness`` 0 bit for bit, the trainer's
wiring (``micro_loss`` on logits) and which log-prob passes each objective needs.

Inputs are built so that every bug named below moves the result: proximal and behaviour
log-probs differ by up to ~2 nats (weights both under and over the cap, and between the
cap and e^cap), and ratios cross both clip bounds with either sign of advantage.
"""
from __future__ import annotations

import math

import pytest
import torch

from grpo_mega import algorithms as A
from grpo_mega.algorithms.off_policy import STALE_TIS_CAP
from grpo_mega.config import AlgorithmConfig, ConfigError, load_config
from grpo_mega.preflight.validate import validate

B, T = 5, 7
LENGTHS = [7, 4, 0, 6, 2]
CLIP_LOW, CLIP_HIGH, CAP = 0.2, 0.28, 1.5


def _case(seed: int = 0, dtype=torch.float64) -> dict:
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
    prox = logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    behav = prox + 0.8 * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return {k: v.to(dtype) if v.is_floating_point() else v
            for k, v in dict(logp=logp, prox=prox, behav=behav, mask=mask, adv=adv).items()}


def _reference(c: dict, *, anchor: str, cap, mode: str = "clamp") -> tuple[float, list[list[float]]]:
    """token-mean of -w * min(r A, clip(r) A), r = pi_theta / pi_anchor, and its gradient
    d loss / d logp per token, one Python float at a time (float64). ``anchor``: "prox" or
    "behav"; ``cap``: None (no weight), "none" (untruncated weight) or a number, applied as
    ``mode``: "clamp" (min(w, cap)) or "mask" (AReaL: w = 0 where w > cap)."""
    rows, cols = c["mask"].shape
    n = int(c["mask"].sum())
    total, grad = 0.0, [[0.0] * cols for _ in range(rows)]
    for i in range(rows):
        a = float(c["adv"][i])
        for t in range(cols):
            if not c["mask"][i, t]:
                continue
            lp, px, bh = (float(c[k][i, t]) for k in ("logp", "prox", "behav"))
            r = math.exp(lp - (px if anchor == "prox" else bh))
            w = 1.0 if cap is None else math.exp(px - bh)
            if isinstance(cap, float):
                w = min(w, cap) if mode == "clamp" else (0.0 if w > cap else w)
            clipped = min(max(r, 1 - CLIP_LOW), 1 + CLIP_HIGH)
            total += -w * min(r * a, clipped * a)
            # the unclipped branch is the min (or the clip does not bind): gradient r A
            if r * a <= clipped * a:
                grad[i][t] = -w * a * r / n
    return total / n, grad


def _ours(c: dict, *, off_policy: str, cap, rollout: bool, mode: str = "clamp"):
    logp = c["logp"].clone().requires_grad_()
    loss, m = A.policy_loss(logp, c["prox"], c["adv"], c["mask"], clip_low=CLIP_LOW, clip_high=CLIP_HIGH,
                            rollout_logp=c["behav"] if rollout else None, tis_cap=cap, off_policy=off_policy,
                            tis_mode=mode)
    loss.backward()
    return loss, logp.grad, m


def _assert_matches(loss, grad, ref_loss, ref_grad):
    torch.testing.assert_close(loss, torch.tensor(ref_loss, dtype=torch.float64), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, torch.tensor(ref_grad, dtype=torch.float64), rtol=1e-12, atol=1e-14)


def test_off_policy_inputs_exercise_every_branch():
    """Guards against a case too tame to catch the bugs below: weights under and over the cap
    and between the cap and e^cap, ratios past both clip bounds against either anchor."""
    c = _case()
    m = c["mask"]
    w = (c["prox"] - c["behav"]).exp()[m]
    assert (w < 1).any() and ((w > 1) & (w < CAP)).any() and ((w > CAP) & (w < math.exp(CAP))).any()
    for anchor in ("prox", "behav"):
        r = (c["logp"] - c[anchor]).exp()[m]
        assert (r < 1 - CLIP_LOW).any() and (r > 1 + CLIP_HIGH).any(), anchor


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_off_policy_decoupled_matches_fp64_reference(seed):
    """Guards against the decoupled objective's bugs: the importance weight inverted
    (behaviour / proximal), the cap applied to the log-weight (min(log w, cap): weights up
    to e^cap) or not applied, and the clip anchored on the behaviour log-probs instead of
    the proximal ones. Loss and d loss / d logp against the per-token fp64 reference."""
    c = _case(seed)
    loss, grad, m = _ours(c, off_policy="decoupled", cap=CAP, rollout=True)
    _assert_matches(loss, grad, *_reference(c, anchor="prox", cap=CAP))
    w = (c["prox"] - c["behav"]).exp()[c["mask"]]
    torch.testing.assert_close(m["tis_weight_mean"], w.clamp(max=CAP).mean().float())
    torch.testing.assert_close(m["tis_clipfrac"], (w > CAP).double().mean().float())
    # no cap but behaviour log-probs given: the untruncated weight
    loss, grad, _ = _ours(c, off_policy="decoupled", cap=None, rollout=True)
    _assert_matches(loss, grad, *_reference(c, anchor="prox", cap="none"))


@pytest.mark.parametrize("seed", [0, 1])
def test_async_masked_behaviour_weight_matches_areal_fp64_reference(seed):
    """Issue 40 finding 5: a set cap clamped the weight where AReaL's decoupled objective
    masks the token (``behav_imp_weight_cap``). Under ``tis_mode=mask`` a token whose weight
    pi_prox / pi_b passes the cap must leave the surrogate (weight 0; the denominator
    still counts it, as AReaL's), the others keep their untruncated weight: loss and
    d loss / d logp against the fp64 reference, and ``tis_clipfrac`` counts the masked."""
    c = _case(seed)
    loss, grad, m = _ours(c, off_policy="decoupled", cap=CAP, rollout=True, mode="mask")
    _assert_matches(loss, grad, *_reference(c, anchor="prox", cap=CAP, mode="mask"))
    w = (c["prox"] - c["behav"]).exp()[c["mask"]]
    torch.testing.assert_close(m["tis_weight_mean"], torch.where(w > CAP, 0.0, w).mean().float())
    torch.testing.assert_close(m["tis_clipfrac"], (w > CAP).double().mean().float())


def test_async_stale_samples_are_corrected_by_default():
    """Issue 40 finding 5: with ``max_staleness >= 1`` the default ``tis_cap: null`` applied no
    behaviour correction at all (only a warning). The default must now weight stale samples
    (AReaL's masking at ``STALE_TIS_CAP``) while the synchronous loop keeps no weight and
    clamping, ``tis_mode=off`` opts out, and ``behaviour`` never weighs."""
    cfg = AlgorithmConfig()
    assert cfg.tis_cap is None and cfg.tis_mode == "auto"
    assert A.behaviour_correction("decoupled", None, "auto", 0) == (None, "clamp")
    assert A.behaviour_correction("decoupled", 2.0, "auto", 0) == (2.0, "clamp")
    assert A.behaviour_correction("decoupled", None, "auto", 1) == (STALE_TIS_CAP, "mask")
    assert A.behaviour_correction("decoupled", 2.0, "clamp", 3) == (2.0, "clamp")
    assert A.behaviour_correction("decoupled", None, "off", 2) == (None, "clamp")
    assert A.behaviour_correction("behaviour", None, "auto", 2) == (None, "clamp")
    with pytest.raises(ValueError, match="--algorithm.tis_mode"):
        A.behaviour_correction("decoupled", None, "truncate", 1)
    with pytest.raises(ConfigError, match="algorithm.tis_mode"):
        validate(load_config(None, ["--algorithm.tis_mode=truncate"]), 1, check_hardware=False)


@pytest.mark.parametrize("seed", [0, 1])
def test_off_policy_behaviour_clips_on_rollout_logprobs_without_weight(seed):
    """Guards against ``behaviour`` anchoring the clip on the proximal log-probs (it would
    equal decoupled without a weight) or weighting its tokens: naive PPO on the behaviour
    policy, against the fp64 reference; a cap is refused rather than ignored."""
    c = _case(seed)
    loss, grad, m = _ours(c, off_policy="behaviour", cap=None, rollout=True)
    _assert_matches(loss, grad, *_reference(c, anchor="behav", cap=None))
    assert "tis_weight_mean" not in m
    with pytest.raises(ValueError, match="tis_cap"):
        _ours(c, off_policy="behaviour", cap=CAP, rollout=True)
    with pytest.raises(ValueError, match="rollout_logp"):
        _ours(c, off_policy="behaviour", cap=None, rollout=False)


def _todays_loss(logp, old, adv, mask, rollout=None, cap=None):
    """The token-mean surrogate of ``policy_loss`` before the off-policy registry (main at
    1309049), op for op in the dtype of the inputs: the definition of "today's loss" that
    the decoupled objective must reproduce bit for bit."""
    a = adv[:, None].expand_as(logp).detach().to(logp.dtype)
    log_ratio = torch.where(mask, logp - old.detach(), torch.zeros_like(logp))
    ratio = log_ratio.exp()
    pg = torch.maximum(-a * ratio, -a * ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH))
    if rollout is not None:
        with torch.no_grad():
            w = torch.where(mask, old - rollout, torch.zeros_like(old)).exp()
            w = w.clamp(max=cap) if cap is not None else w
        pg = pg * w.to(pg.dtype)
    return torch.where(mask, pg, torch.zeros_like(pg)).sum() / max(int(mask.sum()), 1)


def _ps():
    from grpo_mega.distributed.state import ParallelState

    return ParallelState(rank=0, world_size=1, tp=1, pp=1, dp=1, tp_rank=0, pp_rank=0, dp_rank=0,
                         tp_group=None, pp_group=None, dp_group=None, mp_group=None,
                         embedding_group=None, device=torch.device("cpu"))


def _micro(seed: int = 0):
    """A TrainingBatch of 4 ragged rows and fp32 logits [4, S, 64] (vocab 50, padded)."""
    from grpo_mega.trainer.batch import TrainingBatch

    g = torch.Generator().manual_seed(seed)
    prompts = [[5, 6, 7], [8], [9, 10], [11, 12, 13, 14]]
    responses = [[20, 21, 22], [23, 24, 25, 26, 27], [28], [29, 30, 31, 32]]
    rollout = [[-0.5 - 0.7 * float(torch.rand(1, generator=g)) for _ in r] for r in responses]
    mb = TrainingBatch.pack(prompts, responses, rollout, [0.9, -1.3, 0.4, -0.6], pad_id=0)
    n, s = mb.tokens.shape
    logits = torch.randn(n, s, 64, generator=g) * 2
    return mb, logits


def _micro_loss(mb, logits, algo, reuse: bool):
    from grpo_mega.trainer.passes import micro_loss

    x = logits.clone().requires_grad_()
    n = int(mb.loss_mask.sum())
    loss, m, logp = micro_loss(x, mb, _ps(), algo, vocab_size=50, temperature=1.0, max_len=8,
                               reuse_current_as_old=reuse, global_tokens=n, global_seqs=len(mb),
                               all_positions=True)
    return x, loss, m, logp


def _needs_proximal(algo: AlgorithmConfig) -> bool:
    return A.proximal_pass_needed(algo.off_policy, ppo_epochs=algo.ppo_epochs, mini_batches=1,
                                  max_staleness=algo.max_staleness, tis_cap=algo.tis_cap)


def test_off_policy_decoupled_at_staleness_0_reduces_bitwise_to_todays_loss():
    """Guards against the S = 0 reduction not being exact: the synchronous loop's decoupled
    objective with no cap must be today's on-policy loss bit for bit (loss and gradient
    w.r.t. the logits), with no proximal pass and the engine's log-probs never read (a
    weight applied without a cap, or a ratio formed via the behaviour log-probs, moves
    bits). With a cap it is today's TIS, bit for bit."""
    mb, logits = _micro()
    algo = AlgorithmConfig(kl_coef=0.0, clip_low=CLIP_LOW, clip_high=CLIP_HIGH)
    assert algo.off_policy == "decoupled" and algo.max_staleness == 0 and algo.tis_cap is None
    assert not _needs_proximal(algo)
    x, loss, _, logp = _micro_loss(mb, logits, algo, reuse=True)
    today = _todays_loss(logp, logp.detach(), mb.advantages, mb.loss_mask)
    assert torch.equal(loss, today), (loss, today)
    g_new, = torch.autograd.grad(loss, x, retain_graph=True)
    g_today, = torch.autograd.grad(today, x)
    assert torch.equal(g_new, g_today)
    assert bool((mb.rollout_logp[mb.loss_mask] != logp.detach()[mb.loss_mask]).all())  # a weight would show
    # today's TIS: cap set; the proximal pass runs when the policy moves (two epochs here), so
    # old_logp differs from the current log-probs
    algo = AlgorithmConfig(kl_coef=0.0, clip_low=CLIP_LOW, clip_high=CLIP_HIGH, tis_cap=CAP, ppo_epochs=2)
    assert _needs_proximal(algo)
    mb.old_logp = mb.rollout_logp + 0.9 * torch.randn(mb.rollout_logp.shape, generator=torch.Generator().manual_seed(4))
    x, loss, _, logp = _micro_loss(mb, logits, algo, reuse=False)
    today = _todays_loss(logp, mb.old_logp, mb.advantages, mb.loss_mask, mb.rollout_logp, CAP)
    assert torch.equal(loss, today), (loss, today)
    g_new, = torch.autograd.grad(loss, x, retain_graph=True)
    g_today, = torch.autograd.grad(today, x)
    assert torch.equal(g_new, g_today)


@pytest.mark.parametrize("off_policy, cap, mode, want_cap", [
    ("decoupled", CAP, "clamp", CAP), ("decoupled", CAP, "auto", CAP),
    ("decoupled", None, "auto", STALE_TIS_CAP), ("behaviour", None, "auto", None)])
def test_off_policy_stale_update_through_micro_loss_matches_fp64_reference(off_policy, cap, mode, want_cap):
    """Guards against the trainer's wiring at max_staleness 1 (two PPO epochs, so the
    proximal pass runs): ``micro_loss`` not passing ``algorithm.off_policy`` (behaviour would
    train as decoupled), not passing the rollout's log-probs where the objective reads them
    (behaviour always, decoupled with a cap, and by default at S >= 1: issue 40 finding 5),
    not passing the cap's mode (``auto`` is AReaL's mask at S >= 1), or reusing the current
    log-probs as proximal when the policy moves. The proximal log-probs (as the proximal
    pass would write them) differ from the current ones; loss and d loss / d logp against
    the fp64 reference."""
    mb, logits = _micro(1)
    algo = AlgorithmConfig(kl_coef=0.0, clip_low=CLIP_LOW, clip_high=CLIP_HIGH, tis_cap=cap, tis_mode=mode,
                           off_policy=off_policy, max_staleness=1, ppo_epochs=2)
    g = torch.Generator().manual_seed(5)
    mb.old_logp = mb.rollout_logp + 0.8 * torch.randn(mb.rollout_logp.shape, generator=g)
    x, loss, m, logp = _micro_loss(mb, logits, algo, reuse=not _needs_proximal(algo))
    logp.retain_grad()
    loss.backward()
    rows = mb.loss_mask
    c = dict(logp=logp.detach().double(), behav=mb.rollout_logp.double(), mask=rows,
             prox=mb.old_logp.double(), adv=mb.advantages.double())
    ref_loss, ref_grad = _reference(c, anchor="prox" if off_policy == "decoupled" else "behav", cap=want_cap,
                                    mode="mask" if mode == "auto" else mode)
    torch.testing.assert_close(loss.double(), torch.tensor(ref_loss, dtype=torch.float64), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logp.grad.double(), torch.tensor(ref_grad, dtype=torch.float64),
                               rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("off_policy, max_staleness, epochs, minis, cap, expected", [
    ("decoupled", 0, 1, 1, None, False),   # synchronous, on-policy: the update is the old pass
    ("decoupled", 0, 2, 1, None, True),
    ("decoupled", 0, 1, 3, None, True),
    ("decoupled", 0, 1, 1, 2.0, False),    # TIS at one optimizer step: the update's log-probs are proximal
    ("decoupled", 1, 1, 1, None, False),   # stale, one optimizer step: the pass changes nothing
    ("decoupled", 4, 1, 1, 2.0, False),
    ("decoupled", 2, 2, 1, None, True),    # stale and the policy moves
    ("behaviour", 0, 1, 1, None, False),
    ("behaviour", 2, 1, 1, None, False),
    ("behaviour", 2, 3, 2, None, False),   # anchors on the rollout: never needs the pass
])
def test_off_policy_proximal_pass_needed(off_policy, max_staleness, epochs, minis, cap, expected):
    """Guards against running the proximal pass where it cannot change the loss (issue 40
    finding 5: one epoch and one mini-batch, stale samples or a cap included: the weights
    the step starts from are the current ones at its only optimizer step, so the update's
    own log-probs, detached, are the proximal ones and give the same weight), against
    skipping it when the policy moves (epochs or mini-batches), against running it for
    ``behaviour`` (a wasted forward)."""
    assert A.proximal_pass_needed(off_policy, ppo_epochs=epochs, mini_batches=minis,
                                  max_staleness=max_staleness, tis_cap=cap) is expected
    assert A.behaviour_logp_needed(off_policy, cap) is (off_policy == "behaviour" or cap is not None)


def test_off_policy_config_is_checked_against_its_registry():
    """Guards against ``algorithm.off_policy`` restated by hand in config checks (a name the
    loss cannot run passing validation), against a cap silently ignored under ``behaviour``,
    and against behaviour's ratio on truncated sampling (engine log-probs of the truncated
    distribution against the trainer's full softmax)."""
    with pytest.raises(ConfigError) as err:
        validate(load_config(None, ["--algorithm.off_policy=naive"]), 1, check_hardware=False)
    msg = str(err.value)
    assert "algorithm.off_policy='naive'" in msg and "(--algorithm.off_policy)" in msg, msg
    assert all(repr(n) in msg for n in A.OFF_POLICY.names()), msg
    with pytest.raises(ConfigError, match="--algorithm.tis_cap=null"):
        validate(load_config(None, ["--algorithm.off_policy=behaviour", "--algorithm.tis_cap=2.0"]), 1,
                 check_hardware=False)
    with pytest.raises(ConfigError, match=r"algorithm.off_policy=behaviour .*rollout.top_p=0.9"):
        validate(load_config(None, ["--algorithm.off_policy=behaviour", "--rollout.top_p=0.9"]), 1,
                 check_hardware=False)
    validate(load_config(None, ["--algorithm.off_policy=behaviour"]), 1, check_hardware=False)
    validate(load_config(None, ["--algorithm.off_policy=decoupled", "--rollout.top_p=0.9"]), 1,
             check_hardware=False)
