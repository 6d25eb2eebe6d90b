"""Sample-based KL(pi_theta || pi_ref) estimators for the GRPO KL term.

Each estimator takes x = logp - ref_logp ([B, T], on tokens sampled from
pi_theta) and returns a per-token estimate of the same shape. They are
registered by name (with aliases) in ``KL_ESTIMATORS``; ``algorithm.kl_kind`` in
config is validated against ``KL_ESTIMATORS.names()``. The exact full-vocabulary
KL (verl's ``full``) is ``vocab_parallel_kl``: it needs both policies' logits, not
the log-probs the loss receives, so it is not a ``kl_kind``.
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional

import torch

from grpo_mega.algorithms._checks import Tensor, _same_shape
from grpo_mega.algorithms.registry import Registry

__all__ = ["kl_penalty", "KL_ESTIMATORS", "KL_ALIASES"]

# Each takes x = logp - ref_logp on samples from pi_theta.
KL_ESTIMATORS: Registry[Callable[[Tensor], Tensor]] = Registry("kl_kind")


@KL_ESTIMATORS.register("k1")
def _k1(x: Tensor) -> Tensor:
    return x


@KL_ESTIMATORS.register("k2", "mse")
def _k2(x: Tensor) -> Tensor:
    return 0.5 * x.square()


@KL_ESTIMATORS.register("k3", "low_var_kl")
def _k3(x: Tensor) -> Tensor:
    # exp(-x) + x - 1 with expm1: no cancellation near x = 0, where it matters.
    return torch.expm1(-x) + x


@KL_ESTIMATORS.register("abs")
def _kabs(x: Tensor) -> Tensor:
    return x.abs()


# alias -> canonical name, a live view of KL_ESTIMATORS' aliases
KL_ALIASES: Mapping[str, str] = KL_ESTIMATORS.aliases


def _kl_estimator(kind: str, arg: str = "kind") -> Callable[[Tensor], Tensor]:
    return KL_ESTIMATORS.get(kind, arg)


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str, *,
               clamp: Optional[float] = None) -> Tensor:
    """Elementwise estimator of KL(pi_theta || pi_ref) on tokens sampled from pi_theta.

    With x = logp - ref_logp (same shape, any):
        k1  = x                          unbiased, high variance, can be < 0
        k2  = x^2 / 2        ("mse")     biased, low variance
        k3  = exp(-x) + x - 1 ("low_var_kl")  unbiased, >= 0 (GRPO's choice)
        abs = |x|

    clamp: if given, x is clamped to [-clamp, clamp] first, which keeps k3
        (exponential in -x) finite when the policy drifts far from the
        reference; gradients are zero where the clamp is active.
    Returns: KL estimate, same shape as logp.
    """
    if not isinstance(logp, Tensor):
        raise ValueError("logp must be a tensor")
    _same_shape(logp, "logp", ref_logp, "ref_logp")
    fn = _kl_estimator(kind)
    if clamp is not None and not clamp > 0:
        raise ValueError(f"clamp must be positive or None, got {clamp!r}")
    x = logp - ref_logp
    if clamp is not None:
        x = x.clamp(-clamp, clamp)
    return fn(x)

