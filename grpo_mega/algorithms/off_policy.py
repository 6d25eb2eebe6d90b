"""Off-policy objectives (``algorithm.off_policy``): which policy anchors the PPO clip, and
how samples of an older policy are weighted.

Three policies take part in one update (AReaL's decoupled PPO, Fu et al. 2025):

* behaviour ``pi_b``: the engine weights that sampled each token (with asynchronous GRPO
  up to ``algorithm.max_staleness`` versions old, and a mix of versions within one
  response); its log-probs are the rollout's, ``rollout_logp``;
* proximal ``pi_prox``: the trainer's weights at the start of the step; its log-probs are
  recomputed by the trainer before the update, ``old_logp``;
* current ``pi_theta``: the weights being optimised, ``logp``.

Registered objectives (``OFF_POLICY``):

* ``decoupled``: the clipped ratio is ``pi_theta / pi_prox``, and each token's surrogate
  is weighted by the behaviour weight ``w = pi_prox / pi_b``, detached, bounded by
  ``tis_cap`` in one of two ways (``TIS_MODES``): ``clamp``, ``min(w, cap)`` (truncated IS),
  or ``mask``, ``w`` where ``w <= cap`` and 0 elsewhere (AReaL's ``behav_imp_weight_cap``:
  a token the sampler found much less likely than the proximal policy does leaves the
  gradient instead of being pushed at weight ``cap``). No cap: no weight. The trust region
  is then around a policy the trainer holds, however old the sampler was, and the weight
  corrects for sampling from ``pi_b``. With one version (the synchronous loop) and
  ``clamp`` this is today's truncated IS, and with no cap the on-policy GRPO loss bit for
  bit.
* ``behaviour``: the clipped ratio is ``pi_theta / pi_b``, no weight: naive PPO on stale
  samples, for comparison (AReaL: it collapses at staleness 4). No proximal pass is run.

An objective returns ``OffPolicyTerms`` (the clip's anchor and the weight); ``policy_loss``
does the rest (ratio variant, clip, dual clip, KL, aggregation) the same way for each.
``proximal_pass_needed`` and ``behaviour_logp_needed`` tell the trainer which log-probs an
objective reads, so it runs the old-policy forward only when the objective needs it: when
the step makes one optimizer step (one PPO epoch, one mini-batch) the proximal weights are
the current ones at update time, so the update's own log-probs, detached, are the proximal
ones exactly (the weight included) and the extra forward is skipped even for stale samples.

``behaviour_correction`` is the default with asynchronous GRPO (``max_staleness`` >= 1):
``tis_cap`` null then means ``STALE_TIS_CAP`` and ``tis_mode: auto`` means ``mask``. Why
masking there: AReaL's decoupled objective (Fu et al. 2025, ``ppo_actor_loss_fn``) masks
the tokens whose behaviour weight passes the cap; with stale samples the weights spread
far more than the engine/trainer numeric gap truncated IS was made for, and a clamped
token with ``pi_prox >> pi_b`` still gets the full push of ``cap`` on a token the sampler
barely chose. In the synchronous loop (weights near 1) ``auto`` keeps ``clamp``.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

from grpo_mega.algorithms._checks import Tensor, _masked_mean
from grpo_mega.algorithms.registry import Registry

__all__ = ["OFF_POLICY", "OffPolicyObjective", "OffPolicyTerms", "importance_weight",
           "proximal_pass_needed", "behaviour_logp_needed", "behaviour_correction", "TIS_MODES",
           "STALE_TIS_CAP"]

TIS_MODES = ("auto", "clamp", "mask", "off")
"""``algorithm.tis_mode``: how the cap bounds the behaviour weight (see the module docstring);
``auto``: ``mask`` with ``max_staleness`` >= 1, else ``clamp``; ``off``: no weight at all."""
STALE_TIS_CAP = 5.0
"""The cap used with ``max_staleness`` >= 1 when ``algorithm.tis_cap`` is null (AReaL's
``behav_imp_weight_cap`` in its asynchronous recipes)."""


class OffPolicyTerms(NamedTuple):
    """What an objective contributes to ``policy_loss`` for one micro-batch."""

    anchor: Tensor
    """[B, T] log-probs the ratio is taken against: ratio = exp(logp - anchor) (detached)."""
    weight: Optional[Tensor]
    """[B, T] detached per-token weight of the surrogate, or None for no weight."""
    metrics: dict
    """0-d detached tensors, means over the valid tokens (``tis_weight_mean``, ...)."""


class OffPolicyObjective(NamedTuple):
    """One registered off-policy objective."""

    terms: Callable[[Tensor, Optional[Tensor], Tensor, Optional[float], str], OffPolicyTerms]
    """(proximal [B, T], behaviour [B, T] or None, mask [B, T] bool, cap, mode) -> OffPolicyTerms
    (mode: ``clamp`` or ``mask``, how the cap bounds the weight)."""
    needs_proximal: Callable[[bool, int, Optional[float]], bool]
    """(policy_moves, max_staleness, cap) -> whether the trainer must recompute the proximal
    log-probs before the update; ``policy_moves``: the step makes several optimizer steps
    (PPO epochs or mini-batches), so the current weights leave the proximal ones."""
    reads_behaviour: Callable[[Optional[float]], bool]
    """cap -> whether ``terms`` reads the behaviour (rollout) log-probs."""


OFF_POLICY: Registry[OffPolicyObjective] = Registry("off_policy")


def importance_weight(proximal: Tensor, behaviour: Tensor, mask: Tensor,
                      cap: Optional[float], mode: str = "clamp") -> tuple[Tensor, dict]:
    """Behaviour weight ``w = pi_prox / pi_b`` of each valid token, bounded by ``cap``:
    ``clamp``: ``min(w, cap)`` (truncated IS); ``mask``: ``w`` where ``w <= cap``, else 0.

    Args:
        proximal: [B, T] log-probs of the proximal policy (the trainer's, recomputed).
        behaviour: [B, T] log-probs of the policy that sampled the tokens (the engine's).
        mask: [B, T] bool, valid tokens.
        cap: upper bound of the weight (the weight, not its log); None: untruncated.

    Returns:
        (w [B, T] detached, 1 at padding before the cap; metrics ``tis_weight_mean``,
        ``tis_clipfrac`` (tokens whose weight the cap lowered or masked, with a cap) and
        ``rollout_logp_gap`` (mean |proximal - behaviour|), over the valid tokens).
    """
    with torch.no_grad():
        # Zero the log-weight at padding before exp: garbage there must not become inf.
        gap = torch.where(mask, proximal - behaviour, torch.zeros_like(proximal))
        weight = gap.exp()
        metrics = {}
        if mode not in ("clamp", "mask"):
            raise ValueError(f"tis mode must be 'clamp' or 'mask', got {mode!r} (--algorithm.tis_mode)")
        if cap is not None:
            over = weight > cap
            metrics["tis_clipfrac"] = _masked_mean(over.float(), mask)
            weight = weight.clamp(max=cap) if mode == "clamp" else torch.where(over, torch.zeros_like(weight), weight)
        metrics["rollout_logp_gap"] = _masked_mean(gap.abs(), mask)
        metrics["tis_weight_mean"] = _masked_mean(weight, mask)
    return weight, metrics


def _decoupled_terms(proximal: Tensor, behaviour: Optional[Tensor], mask: Tensor,
                     cap: Optional[float], mode: str = "clamp") -> OffPolicyTerms:
    """AReaL's decoupled PPO: clip pi_theta / pi_prox, weight by pi_prox / pi_b bounded by the
    cap (``mode``; no weight without behaviour log-probs, which the trainer passes only with
    a cap)."""
    if behaviour is None:
        return OffPolicyTerms(proximal, None, {})
    weight, metrics = importance_weight(proximal, behaviour, mask, cap, mode)
    return OffPolicyTerms(proximal, weight, metrics)


def _behaviour_terms(proximal: Tensor, behaviour: Optional[Tensor], mask: Tensor,
                     cap: Optional[float], mode: str = "clamp") -> OffPolicyTerms:
    """Naive PPO on stale samples: clip pi_theta / pi_b against the rollout's log-probs, no
    weight (for comparison with ``decoupled``)."""
    if behaviour is None:
        raise ValueError("off_policy='behaviour' clips against the rollout's log-probs: pass rollout_logp")
    if cap is not None:
        raise ValueError(f"tis_cap={cap!r} caps the weight proximal/behaviour, which off_policy='behaviour' "
                         "does not use; pass tis_cap=None (--algorithm.tis_cap=null) or use 'decoupled'")
    return OffPolicyTerms(behaviour, None, {})


OFF_POLICY.register("decoupled")(OffPolicyObjective(
    _decoupled_terms,
    # One optimizer step: the update's own log-probs, detached, are the proximal ones (and
    # give the same weight), whatever the staleness or cap.
    needs_proximal=lambda policy_moves, max_staleness, cap: policy_moves,
    reads_behaviour=lambda cap: cap is not None))
OFF_POLICY.register("behaviour")(OffPolicyObjective(
    _behaviour_terms,
    needs_proximal=lambda policy_moves, max_staleness, cap: False,
    reads_behaviour=lambda cap: True))


def proximal_pass_needed(off_policy: str, *, ppo_epochs: int, mini_batches: int, max_staleness: int,
                         tis_cap: Optional[float]) -> bool:
    """Whether the trainer must compute the proximal (old-policy) log-probs before the update.

    ``decoupled``: when the current weights are not the proximal ones at every optimizer
    step (``ppo_epochs > 1`` or ``mini_batches > 1``). Otherwise the update reuses its own
    log-probs, detached, as the proximal ones: they are the same numbers (the weights the
    step starts from), so the clip's ratio is 1 and the behaviour weight pi_prox / pi_b is
    the one the extra forward would give, for stale samples and with a cap alike (issue 40
    finding 5: that forward ran and changed nothing). ``behaviour``: never."""
    obj = OFF_POLICY.get(off_policy, "off_policy")
    return bool(obj.needs_proximal(ppo_epochs > 1 or mini_batches > 1, max_staleness, tis_cap))


def behaviour_logp_needed(off_policy: str, tis_cap: Optional[float]) -> bool:
    """Whether ``policy_loss`` must get the rollout's log-probs (``rollout_logp``):
    ``decoupled`` only with a cap (null: no weight), ``behaviour`` always (its anchor)."""
    return bool(OFF_POLICY.get(off_policy, "off_policy").reads_behaviour(tis_cap))


def behaviour_correction(off_policy: str, tis_cap: Optional[float], tis_mode: str,
                         max_staleness: int) -> tuple[Optional[float], str]:
    """The (cap, mode) in force: ``decoupled`` with ``max_staleness`` >= 1 corrects by default
    (a null cap is ``STALE_TIS_CAP``, ``auto`` is ``mask``); at S = 0 a null cap is no weight
    and ``auto`` is ``clamp``; ``tis_mode: off`` and ``behaviour`` weigh nothing (cap None)."""
    if tis_mode not in TIS_MODES:
        raise ValueError(f"algorithm.tis_mode={tis_mode!r} is not one of {TIS_MODES} (--algorithm.tis_mode)")
    stale = max_staleness >= 1
    if off_policy != "decoupled" or tis_mode == "off":
        return None, "clamp"
    mode = ("mask" if stale else "clamp") if tis_mode == "auto" else tis_mode
    return (STALE_TIS_CAP if tis_cap is None and stale else tis_cap), mode
