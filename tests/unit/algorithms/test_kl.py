"""Tests for grpo_mega.algorithms.kl: each estimator's formula and sign, the aliases,
and the clamp that keeps k3 finite.
"""
from __future__ import annotations

import math

import pytest
import torch

from grpo_mega.algorithms import kl_penalty


def test_kl_estimators_formulas_and_aliases():
    """Guards the sign convention x = logp - ref_logp in each estimator and the aliases."""
    logp = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-1.5, -1.0, -0.5])
    x = logp - ref
    want = {"k1": x, "k2": 0.5 * x ** 2, "k3": torch.exp(-x) + x - 1, "abs": x.abs()}
    for kind, w in want.items():
        torch.testing.assert_close(kl_penalty(logp, ref, kind), w)
    torch.testing.assert_close(kl_penalty(logp, ref, "mse"), want["k2"])
    torch.testing.assert_close(kl_penalty(logp, ref, "low_var_kl"), want["k3"])


def test_kl_clamp_keeps_k3_finite():
    """Guards against exp(ref_logp - logp) overflowing to inf when the policy has
    drifted far from the reference."""
    logp, ref = torch.tensor([-200.0]), torch.tensor([0.0])
    assert torch.isinf(kl_penalty(logp, ref, "k3")).all()
    got = kl_penalty(logp, ref, "k3", clamp=20.0)
    torch.testing.assert_close(got, torch.tensor([math.exp(20) - 20 - 1]))


# ---------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------

_lp = torch.zeros(2, 3)
BAD_INPUTS = {
    "unknown_kl_kind": (lambda: kl_penalty(_lp, _lp, "k4"), "kind"),
    "kl_broadcast": (lambda: kl_penalty(torch.zeros(3), torch.zeros(1), "k1"), "ref_logp"),
    "full_needs_logits": (lambda: kl_penalty(_lp, _lp, "full"), "needs both policies' logits"),
}


@pytest.mark.parametrize("bad", sorted(BAD_INPUTS))
def test_bad_input_raises_value_error_naming_argument(bad):
    """Guards against an unknown estimator name passing silently and against
    broadcasting a reference of the wrong shape."""
    fn, arg = BAD_INPUTS[bad]
    with pytest.raises(ValueError, match=arg):
        fn()
