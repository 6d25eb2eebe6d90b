"""The GRPO loss: clipped surrogate + KL + truncated IS, reduced by a registered aggregation.

* ``policy_loss``: the objective to minimise for one micro-batch. The clip's anchor and
  the importance weight come from the registered off-policy objective
  (``off_policy.OFF_POLICY``, ``algorithm.off_policy``: ``decoupled`` or ``behaviour``).
* ``POLICY_LOSSES``: the registered surrogates (``algorithm.policy_loss``):
  ``grpo`` (per-token PPO ratio, clipped per token) and ``gspo`` (GSPO: one
  length-normalised ratio per sequence, clipped per sequence).
* ``aggregate``: per-token values [B, T] -> this micro-batch's share of the
  loss, in one of the modes registered in ``AGGREGATIONS`` (``algorithm.loss_agg``
  in config is validated against it).
* ``global_batch_counts``: the token/sequence counts that make micro-batch and
  data-parallel splits give the same loss and gradients.

Global normalisation contract (micro-batches and data parallelism)
    A training step sees a global batch split over DP ranks and, on each rank,
    into micro-batches (split by whole sequences, never inside one). Each
    micro-batch's loss is ``sum(contributions) / global_count``, where the
    count is over the WHOLE global batch (``global_batch_counts``). Summing the
    micro-batch losses of all ranks then gives exactly the global mean, so the
    gradients must be SUMMED over micro-batches and DP ranks. With megatron's
    pipeline schedule (``get_forward_backward_func``) that means either:

    1. legacy ``loss_func -> (loss, metrics)``: the schedule divides the loss by
       ``num_microbatches`` (and multiplies by the CP size), and megatron's DDP
       averages gradients over DP. Return
       ``loss * num_microbatches * dp_size`` (``/ cp_size`` with CP) to undo
       both; or
    2. ``config.calculate_per_token_loss=True`` and
       ``loss_func -> (loss, count, metrics)``: the schedule leaves the loss
       alone, DDP sums, and ``finalize_model_grads`` divides all gradients by
       the count summed over micro-batches and DP. Call ``policy_loss`` with
       ``global_tokens=1`` (``token-mean``) or ``global_seqs=1`` (``seq-*``
       modes), so the loss is a plain sum, and return as ``count`` the local
       token (or non-empty sequence) count as a ``torch.int`` tensor. No
       pre-pass for counts is needed then.

    Also clone any loss value you log: the schedule divides it in place.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from grpo_mega.algorithms._checks import (Count, Tensor, _all_reduce, _as_bool_mask, _masked, _masked_mean,
                                         _same_shape)
from grpo_mega.algorithms.kl import _kl_estimator
from grpo_mega.algorithms.off_policy import OFF_POLICY
from grpo_mega.algorithms.registry import Registry

__all__ = ["policy_loss", "aggregate", "global_batch_counts", "AGGREGATIONS", "Aggregation",
           "POLICY_LOSSES"]


class Aggregation(NamedTuple):
    """One loss-reduction mode: the numerator over a micro-batch, and the count dividing it."""

    numerator: Callable[[Tensor, Tensor, Optional[int]], Tensor]
    """(values [B, T], bool mask [B, T], max_len) -> 0-d sum over this micro-batch."""
    count: str
    """"tokens" or "seqs": which global count (``global_batch_counts``) divides it."""
    needs_max_len: bool = False
    """Whether the numerator divides by ``max_len`` (which must then be given)."""


AGGREGATIONS: Registry[Aggregation] = Registry("mode")


def _aggregation(name: str, count: str, *, needs_max_len: bool = False):
    """Register the decorated numerator as aggregation ``name`` divided by ``count``."""
    if count not in ("tokens", "seqs"):
        raise ValueError(f"aggregation {name!r}: count must be 'tokens' or 'seqs', got {count!r}")

    def deco(fn):
        AGGREGATIONS.register(name)(Aggregation(fn, count, needs_max_len))
        return fn

    return deco


@_aggregation("token-mean", "tokens")
def _agg_token_mean(v: Tensor, mask: Tensor, max_len) -> Tensor:
    return _masked(v, mask).sum()


@_aggregation("seq-mean-token-mean", "seqs")
def _agg_seq_mean_token_mean(v: Tensor, mask: Tensor, max_len) -> Tensor:
    # DeepSeekMath: 1/G sum_i 1/|o_i| sum_t; empty rows give 0/1 = 0, not NaN.
    lengths = mask.sum(dim=-1).clamp(min=1)
    return (_masked(v, mask).sum(dim=-1) / lengths).sum()


@_aggregation("seq-mean-token-sum", "seqs")
def _agg_seq_mean_token_sum(v: Tensor, mask: Tensor, max_len) -> Tensor:
    return _masked(v, mask).sum()


@_aggregation("seq-mean-token-sum-norm", "seqs", needs_max_len=True)
def _agg_seq_mean_token_sum_norm(v: Tensor, mask: Tensor, max_len) -> Tensor:
    # Dr. GRPO: a constant per-token weight 1/max_len removes the length bias
    # that 1/|o_i| introduces while keeping the loss scale independent of T.
    return _masked(v, mask).sum() / max_len


def _local_counts(mask: Tensor) -> Tuple[Tensor, Tensor]:
    """(valid tokens, non-empty sequences) of a bool mask [B, T]."""
    return mask.sum(), mask.any(dim=-1).sum()


def _check_count(count, name: str):
    if count is None:
        return None
    if isinstance(count, Tensor):
        if count.numel() != 1:
            raise ValueError(f"{name} must be a scalar, got shape {tuple(count.shape)}")
        return count.clamp(min=1)
    if isinstance(count, bool) or not isinstance(count, (int, float)) or count < 0:
        raise ValueError(f"{name} must be a non-negative number, got {count!r}")
    # A globally empty batch has a zero numerator; dividing by 1 keeps it 0, not NaN.
    return max(count, 1)


def aggregate(values: Tensor, mask: Tensor, mode: str, *, max_len: Optional[int] = None,
              global_tokens: Optional[Count] = None,
              global_seqs: Optional[Count] = None) -> Tensor:
    """Reduce per-token values [B, T] to this micro-batch's share of the loss.

    Args:
        values: [B, T] per-token values (e.g. per-token loss).
        mask: [B, T] bool (or 0/1) valid-token mask; nonzero means valid.
        mode: one of
            "token-mean":              sum_{i,t} v / N_tokens
            "seq-mean-token-mean":     sum_i (sum_t v / |o_i|) / N_seqs  (DeepSeekMath)
            "seq-mean-token-sum":      sum_{i,t} v / N_seqs
            "seq-mean-token-sum-norm": sum_{i,t} v / (N_seqs * max_len)  (Dr. GRPO)
        max_len: constant length normaliser, required by seq-mean-token-sum-norm
            (use the generation budget, the same for every batch).
        global_tokens / global_seqs: N_tokens / N_seqs over the WHOLE global
            batch (all micro-batches, all DP ranks; see ``global_batch_counts``).
            None means this micro-batch's own count (correct only when it is
            the whole global batch). N_seqs counts sequences with at least one
            valid token: empty responses contribute nothing anywhere.

    Returns:
        0-d tensor. Summing it over micro-batches and DP ranks gives the
        global-batch value, so gradients must be summed, not averaged.
    """
    if not isinstance(values, Tensor) or values.dim() != 2:
        raise ValueError("values must be a 2-D tensor [B, T]")
    _same_shape(values, "values", mask, "mask")
    numerator_fn, count_kind, needs_max_len = AGGREGATIONS.get(mode, "mode")
    if needs_max_len:
        if max_len is None or isinstance(max_len, bool) or not max_len > 0:
            raise ValueError(f"max_len must be a positive number for mode={mode!r}, got {max_len!r}")
    tokens = _check_count(global_tokens, "global_tokens")
    seqs = _check_count(global_seqs, "global_seqs")
    mask = _as_bool_mask(mask)
    numerator = numerator_fn(values, mask, max_len)
    denominator = tokens if count_kind == "tokens" else seqs
    if denominator is None:
        local_tokens, local_seqs = _local_counts(mask)
        denominator = (local_tokens if count_kind == "tokens" else local_seqs).clamp(min=1)
    return numerator / denominator


def global_batch_counts(mask: Union[Tensor, Sequence[Tensor]], dp_group=None) -> Tuple[int, int]:
    """(global_tokens, global_seqs) for ``aggregate`` / ``policy_loss``.

    Args:
        mask: this DP rank's whole step batch: one [B, T] mask, or a list of
            per-micro-batch [B_i, T_i] masks (lengths may differ).
        dp_group: the group the global batch is split over (DP, or DP x CP
            when context parallel splits sequences); None for a single rank.
            Every rank of the group must call this (one all-reduce).

    Returns:
        Python ints: valid tokens, and sequences with at least one valid token,
        summed over the group. Call once per step, before the micro-batch loop.
    """
    masks = [mask] if isinstance(mask, Tensor) else list(mask)
    if not masks or not all(isinstance(m, Tensor) and m.dim() == 2 for m in masks):
        raise ValueError("mask must be a 2-D tensor [B, T] or a non-empty list of them")
    counts = torch.zeros(2, dtype=torch.int64, device=masks[0].device)
    for m in masks:
        t, s = _local_counts(_as_bool_mask(m))
        counts[0] += t
        counts[1] += s
    _all_reduce(counts, dist.ReduceOp.SUM, dp_group)
    tokens, seqs = counts.tolist()
    return tokens, seqs


def _check_token_tensor(ref: Tensor, t: Optional[Tensor], name: str) -> None:
    if t is not None:
        _same_shape(ref, "logp", t, name)


POLICY_LOSSES: Registry[Callable[[Tensor, Tensor], Tensor]] = Registry("policy_loss")
"""Surrogate variants: ``(log_ratio [B, T], mask [B, T] bool) -> ratio [B, T]``.

``log_ratio`` is logp - old_logp, already zero at padding. The returned ratio is
what the clip sees at each token: its value decides clipping, its gradient is
the policy gradient's. The clip, dual clip, TIS and aggregation then act on it
the same way for every variant."""


@POLICY_LOSSES.register("grpo", "ppo")
def _ratio_per_token(log_ratio: Tensor, mask: Tensor) -> Tensor:
    return log_ratio.exp()


@POLICY_LOSSES.register("gspo")
def _ratio_per_sequence(log_ratio: Tensor, mask: Tensor) -> Tensor:
    # GSPO (Zheng et al. 2025): s_i = exp(mean over the response of log_ratio),
    # so one sequence is clipped as a whole. Written per token as GSPO-token:
    # value s_i at every token, gradient s_i * grad(logp_t), i.e.
    # sg[s_i] * exp(logp_t - sg[logp_t]); with a per-sequence advantage and
    # seq-mean-token-mean aggregation this is GSPO's gradient exactly.
    lengths = mask.sum(dim=-1, keepdim=True).clamp(min=1)
    seq = (log_ratio.sum(dim=-1, keepdim=True) / lengths).detach()
    return torch.where(mask, (seq + log_ratio - log_ratio.detach()).exp(), torch.ones_like(log_ratio))


def policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
                clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: Optional[float] = None,
                agg: str = "token-mean", variant: str = "grpo", ref_logp: Optional[Tensor] = None, kl_coef: float = 0.0,
                kl_kind: str = "k3", kl: Optional[Tensor] = None,
                rollout_logp: Optional[Tensor] = None,
                tis_cap: Optional[float] = None, off_policy: str = "decoupled", tis_mode: str = "clamp",
                entropy: Optional[Tensor] = None,
                max_len: Optional[int] = None, global_tokens: Optional[Count] = None,
                global_seqs: Optional[Count] = None) -> Tuple[Tensor, dict]:
    """GRPO objective to MINIMISE for one micro-batch.

    Per valid token, with advantage A and ratio r = exp(logp - anchor)
    (``variant="grpo"``) or GSPO's per-sequence r_i = exp(mean_t(logp - anchor))
    (``variant="gspo"``; see ``POLICY_LOSSES``), where the ``off_policy`` objective picks
    the anchor (``decoupled``: old_logp, the proximal policy; ``behaviour``: rollout_logp):
        pg  = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))     (clip-higher
              when clip_high > clip_low, DAPO)
        pg  = min(pg, -A dual_clip)  where A < 0   (dual-clip: bounds the loss of
              a bad action whose ratio exploded; dual_clip > 1)
        pg *= w = min(exp(old_logp - rollout_logp), tis_cap), detached, when
              off_policy="decoupled" and rollout_logp is given (the decoupled
              objective's importance weight proximal/behaviour: corrects for
              samples of an older policy and for the rollout engine's sampler
              differing from the trainer's numerics; tis_cap=None means no
              truncation, high variance. The trainer passes rollout_logp only
              with a cap: ``off_policy.behaviour_logp_needed``)
        tok = pg + kl_coef * kl_penalty(logp, ref_logp, kl_kind)
              (kl_kind="full": tok = pg + kl_coef * kl, the exact per-token KL)
    loss = aggregate(tok, mask, agg, ...). The TIS weight multiplies only the
    surrogate: the KL term is a regulariser on the current samples (as in verl).

    Args:
        logp: [B, T] current-policy log-probs (differentiable).
        old_logp: [B, T] log-probs of the proximal policy (the trainer's weights at the
            start of the step, recomputed; or the current log-probs, detached, when
            the update is on-policy), no grad needed.
        advantages: [B, T] per token, or [B] per sequence (expanded over T;
            the only broadcast allowed).
        mask: [B, T] bool (or 0/1) valid response tokens.
        ref_logp: [B, T] reference log-probs; required when kl_coef != 0 and
            kl_kind is a sample estimator (k1/k2/k3/abs).
        kl: [B, T] exact per-token KL(pi_theta || pi_ref), for kl_kinds that need
            logits (``full``): ``exact_kl(kl_kind, logits_shard, ref_logits_shard,
            tp_group)``, differentiable w.r.t. the policy logits; required when
            kl_coef != 0 with such a kind, refused with the others.
        rollout_logp: [B, T] log-probs reported by the rollout engine (the behaviour
            policy, which sampled the tokens).
        off_policy: an ``OFF_POLICY`` name (``decoupled`` / ``behaviour``).
        tis_mode: ``clamp`` (min(w, tis_cap)) or ``mask`` (w, or 0 where w > tis_cap: AReaL).
        entropy: [B, T] per-token entropy, logged only (no bonus in the loss).
        agg, max_len, global_tokens, global_seqs: see ``aggregate``.
        variant: a ``POLICY_LOSSES`` name: how the ratio is formed.

    Returns:
        (loss, metrics). loss: 0-d tensor, this micro-batch's share of the
        global loss. metrics: 0-d detached tensors; ``pg_loss`` / ``kl_loss``
        are shares like the loss (sum them over micro-batches and ranks), the
        others are means over this micro-batch's valid tokens:
        ``clipfrac_low`` / ``clipfrac_high`` (tokens where the lower / upper
        clip removed the gradient), ``dual_clipfrac``, ``ratio_mean``, ``kl``,
        ``entropy``, ``rollout_logp_gap`` (mean |old_logp - rollout_logp|),
        ``tis_weight_mean``, ``tis_clipfrac``.
    """
    if not isinstance(logp, Tensor) or logp.dim() != 2:
        raise ValueError("logp must be a 2-D tensor [B, T]")
    _same_shape(logp, "logp", old_logp, "old_logp")
    _same_shape(logp, "logp", mask, "mask")
    for t, name in ((ref_logp, "ref_logp"), (rollout_logp, "rollout_logp"), (entropy, "entropy"),
                    (kl, "kl")):
        _check_token_tensor(logp, t, name)
    if not isinstance(advantages, Tensor) or advantages.shape not in (logp.shape, logp.shape[:1]):
        got = tuple(advantages.shape) if isinstance(advantages, Tensor) else type(advantages).__name__
        raise ValueError(f"advantages must have shape [B, T]={tuple(logp.shape)} or "
                         f"[B]={tuple(logp.shape[:1])}, got {got}")
    if not 0 <= clip_low < 1:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low!r}")
    if not clip_high >= 0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high!r}")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip must be > 1 or None, got {dual_clip!r}")
    if tis_cap is not None and not tis_cap > 0:
        raise ValueError(f"tis_cap must be > 0 or None, got {tis_cap!r}")
    if tis_cap is not None and rollout_logp is None:
        raise ValueError("tis_cap needs rollout_logp")
    kl_est = _kl_estimator(kl_kind, "kl_kind")  # fail on a bad name even when the KL term is off
    if kl_est.needs_logits:
        if kl_coef != 0 and kl is None:
            raise ValueError(f"kl_kind={kl_kind!r} needs kl= (the exact per-token KL from both "
                             f"policies' logits, exact_kl) when kl_coef={kl_coef!r} is nonzero")
    elif kl is not None:
        raise ValueError(f"kl= is the exact KL of kl_kind='full'; kl_kind={kl_kind!r} estimates "
                         "it from ref_logp instead")
    elif kl_coef != 0 and ref_logp is None:
        raise ValueError(f"ref_logp is required when kl_coef={kl_coef!r} is nonzero")
    AGGREGATIONS.get(agg, "agg")
    ratio_fn = POLICY_LOSSES.get(variant, "variant")
    objective = OFF_POLICY.get(off_policy, "off_policy")

    mask = _as_bool_mask(mask)
    terms = objective.terms(old_logp.detach(), None if rollout_logp is None else rollout_logp.detach(),
                            mask, tis_cap, tis_mode)
    adv = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(logp)
    adv = adv.detach().to(logp.dtype)
    # Zero the log-ratio at padding BEFORE exp: garbage there must not become
    # inf, whose 0-weighted gradient would still be NaN.
    log_ratio = torch.where(mask, logp - terms.anchor, torch.zeros_like(logp))
    ratio = ratio_fn(log_ratio, mask)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    if dual_clip is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * dual_clip), pg)

    metrics: dict = {}
    with torch.no_grad():
        metrics["clipfrac_low"] = _masked_mean(((adv < 0) & (ratio < 1 - clip_low)).float(), mask)
        metrics["clipfrac_high"] = _masked_mean(((adv > 0) & (ratio > 1 + clip_high)).float(), mask)
        if dual_clip is not None:
            metrics["dual_clipfrac"] = _masked_mean(((adv < 0) & (ratio > dual_clip)).float(), mask)
        metrics["ratio_mean"] = _masked_mean(ratio, mask)
        if entropy is not None:
            metrics["entropy"] = _masked_mean(entropy, mask)

    metrics.update(terms.metrics)
    if terms.weight is not None:
        pg = pg * terms.weight.to(pg.dtype)

    counts = dict(max_len=max_len, global_tokens=global_tokens, global_seqs=global_seqs)
    loss = aggregate(pg, mask, agg, **counts)
    metrics["pg_loss"] = loss.detach().clone()
    tok_kl = None
    if kl_est.needs_logits and kl is not None:
        # Padding rows hold finite garbage logits; zero them (value and gradient).
        tok_kl = torch.where(mask, kl.to(logp.dtype), torch.zeros_like(logp))
    elif not kl_est.needs_logits and ref_logp is not None:
        # Same zero-at-padding guard as the ratio: k3 is exponential in -x.
        ref_log_ratio = torch.where(mask, logp - ref_logp.detach(), torch.zeros_like(logp))
        tok_kl = kl_est.fn(ref_log_ratio)
    if tok_kl is not None:
        metrics["kl"] = _masked_mean(tok_kl.detach(), mask)
        if kl_coef != 0:
            kl_loss = aggregate(tok_kl, mask, agg, **counts)
            metrics["kl_loss"] = kl_loss.detach().clone()
            loss = loss + kl_coef * kl_loss
    return loss, metrics
