"""KL(pi_theta || pi_ref) for the GRPO KL term: sample estimators and the exact ``full``.

Two kinds of entries sit in one registry, ``KL_ESTIMATORS`` (``algorithm.kl_kind`` in
config is validated against ``KL_ESTIMATORS.names()``), each a ``KLEstimator``:

* sample estimators (``needs_logits=False``): ``fn(x)`` with x = logp - ref_logp
  ([B, T], on tokens sampled from pi_theta) returns a per-token estimate of the same
  shape (k1, k2/mse, k3/low_var_kl, abs);
* ``full`` (``needs_logits=True``): the exact sum_v p (log p - log q) over the whole
  vocabulary, ``fn(logits_shard, ref_logits_shard, tp_group) -> [...]`` on vocab
  shards (``vocab_parallel_kl``). It needs both policies' logits, not log-probs, so the
  loss takes its result as ``policy_loss(..., kl=...)``; :func:`exact_kl` computes it.

A plain function registered with ``@KL_ESTIMATORS.register(name)`` counts as a sample
estimator.
"""
from __future__ import annotations

from typing import Callable, Mapping, NamedTuple, Optional

import torch

from grpo_mega.algorithms._checks import Tensor, _same_shape
from grpo_mega.algorithms.registry import Registry
from grpo_mega.algorithms.vocab_parallel import vocab_parallel_kl

__all__ = ["kl_penalty", "exact_kl", "kl_needs_logits", "KLEstimator", "KL_ESTIMATORS", "KL_ALIASES"]


class KLEstimator(NamedTuple):
    """One ``kl_kind``."""

    fn: Callable[..., Tensor]
    """``needs_logits=False``: x = logp - ref_logp [B, T] -> [B, T] estimate.
    ``needs_logits=True``: (logits_shard [..., V/tp], ref_logits_shard [..., V/tp],
    tp_group, **sampling) -> [...] exact KL, differentiable w.r.t. the policy logits only;
    ``sampling`` is ``chunk_size``/``temperature``/``vocab_size`` as in ``vocab_parallel_kl``."""
    needs_logits: bool = False
    """Whether the loss needs the reference LOGITS per token (not just its log-probs)."""


KL_ESTIMATORS: Registry[KLEstimator] = Registry("kl_kind")


def _sample(name: str, *aliases: str):
    def deco(fn):
        KL_ESTIMATORS.register(name, *aliases)(KLEstimator(fn))
        return fn
    return deco


@_sample("k1")
def _k1(x: Tensor) -> Tensor:
    return x


@_sample("k2", "mse")
def _k2(x: Tensor) -> Tensor:
    return 0.5 * x.square()


@_sample("k3", "low_var_kl")
def _k3(x: Tensor) -> Tensor:
    # exp(-x) + x - 1 with expm1: no cancellation near x = 0, where it matters.
    return torch.expm1(-x) + x


@_sample("abs")
def _kabs(x: Tensor) -> Tensor:
    return x.abs()


# verl's ``full`` (which verl refuses with NotImplementedError): exact, zero variance,
# one [tokens, V/tp] reference shard per micro-batch and a few all-reduces over [tokens].
KL_ESTIMATORS.register("full")(KLEstimator(vocab_parallel_kl, needs_logits=True))

# alias -> canonical name, a live view of KL_ESTIMATORS' aliases
KL_ALIASES: Mapping[str, str] = KL_ESTIMATORS.aliases


def _kl_estimator(kind: str, arg: str = "kind") -> KLEstimator:
    entry = KL_ESTIMATORS.get(kind, arg)
    # A plain function registered with ``@KL_ESTIMATORS.register(name)`` is a sample estimator.
    return entry if isinstance(entry, KLEstimator) else KLEstimator(entry)


def kl_needs_logits(kind: str) -> bool:
    """True when ``kind`` is computed from both policies' logits (``full``), so the
    trainer must run the reference model next to the policy, micro-batch by micro-batch."""
    return _kl_estimator(kind, "kl_kind").needs_logits


def exact_kl(kind: str, logits_shard: Tensor, ref_logits_shard: Tensor, tp_group=None,
             **sampling) -> Tensor:
    """Per-token exact KL(pi_theta || pi_ref) of a ``needs_logits`` kind.

    Args:
        logits_shard, ref_logits_shard: [..., V/tp] this rank's vocab slice of the
            policy and reference logits of the SAME tokens (same distribution
            transform: temperature, padded-vocab masking).
        tp_group: tensor-parallel group, None for one rank.
        sampling: ``chunk_size``, ``temperature``, ``vocab_size`` of ``vocab_parallel_kl``:
            the transform applied to both raw shards, block by block.
    Returns: [...] KL in nats; gradient flows to ``logits_shard`` only.
    """
    est = _kl_estimator(kind, "kl_kind")
    if not est.needs_logits:
        raise ValueError(f"kl_kind={kind!r} is a sample estimator of log-probs; use kl_penalty")
    return est.fn(logits_shard, ref_logits_shard, tp_group, **sampling)


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str, *,
               clamp: Optional[float] = None) -> Tensor:
    """Elementwise estimator of KL(pi_theta || pi_ref) on tokens sampled from pi_theta.

    With x = logp - ref_logp (same shape, any):
        k1  = x                          unbiased, high variance, can be < 0
        k2  = x^2 / 2        ("mse")     biased, low variance
        k3  = exp(-x) + x - 1 ("low_var_kl")  unbiased, >= 0 (GRPO's choice)
        abs = |x|
    (``full`` needs logits, not log-probs: see :func:`exact_kl`.)

    clamp: if given, x is clamped to [-clamp, clamp] first, which keeps k3
        (exponential in -x) finite when the policy drifts far from the
        reference; gradients are zero where the clamp is active.
    Returns: KL estimate, same shape as logp.
    """
    if not isinstance(logp, Tensor):
        raise ValueError("logp must be a tensor")
    _same_shape(logp, "logp", ref_logp, "ref_logp")
    est = _kl_estimator(kind)
    if est.needs_logits:
        raise ValueError(f"kind={kind!r} is the exact KL over the vocabulary and needs both "
                         "policies' logits: use exact_kl / vocab_parallel_kl")
    if clamp is not None and not clamp > 0:
        raise ValueError(f"clamp must be positive or None, got {clamp!r}")
    x = logp - ref_logp
    if clamp is not None:
        x = x.clamp(-clamp, clamp)
    return est.fn(x)
