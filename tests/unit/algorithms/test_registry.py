"""Tests for grpo_mega.algorithms.registry and the registries built with it: names,
aliases, lookups that name the bad argument, and that each registered variant is
the function the math uses.
"""
from __future__ import annotations

import pytest
import torch

from grpo_mega import algorithms as A
from grpo_mega.algorithms.registry import Registry


def test_register_get_aliases_and_names():
    """Guards against an alias that resolves to the wrong variant, or aliases leaking
    into the Mapping keys (they would be listed twice as separate estimators)."""
    reg = Registry("thing")

    @reg.register("one", "uno", "eins")
    def one():
        return 1

    @reg.register("two")
    def two():
        return 2

    assert reg.get("one") is one and reg.get("uno") is one and reg.get("eins") is one
    assert reg.get("two") is two
    assert list(reg) == ["one", "two"] and len(reg) == 2 and reg["two"] is two
    assert "uno" not in reg and dict(reg.aliases) == {"uno": "one", "eins": "one"}
    assert reg.names() == ("eins", "one", "two", "uno")


def test_unknown_name_names_the_argument_and_lists_known_names():
    """Guards against a bare KeyError (or a silent default) for a typo in a variant name."""
    reg = Registry("mode")
    reg.register("a", "b")(object())
    with pytest.raises(ValueError, match=r"agg='c' is unknown; choose one of \['a', 'b'\]"):
        reg.get("c", "agg")
    with pytest.raises(ValueError, match="mode=None is unknown"):
        reg.get(None)


def test_duplicate_names_are_refused_and_unregister_removes_aliases():
    """Guards against a second variant silently replacing the first under the same
    name or alias (a config would then mean whichever module imported last)."""
    reg = Registry("kl_kind")
    reg.register("k", "alias")(1)
    for clash in (("k",), ("other", "alias"), ("alias",), ("x", "x")):
        with pytest.raises(ValueError, match="already registered|repeated"):
            reg.register(*clash)
    assert reg.names() == ("alias", "k")
    reg.unregister("k")
    assert reg.names() == () and dict(reg.aliases) == {}
    with pytest.raises(KeyError):
        reg.unregister("k")


def test_builtin_registries_hold_the_documented_variants():
    """Guards against a dropped registry entry or a swapped alias (mse must be k2,
    low_var_kl must be k3), which config validation would then refuse or misroute."""
    assert sorted(A.KL_ESTIMATORS) == ["abs", "full", "k1", "k2", "k3"]
    assert dict(A.KL_ALIASES) == {"mse": "k2", "low_var_kl": "k3"}
    assert [n for n, e in A.KL_ESTIMATORS.items() if e.needs_logits] == ["full"]
    assert A.KL_ESTIMATORS["full"].fn is A.vocab_parallel_kl
    x = torch.tensor([0.5, -1.0])
    torch.testing.assert_close(A.KL_ESTIMATORS.get("mse").fn(x), 0.5 * x ** 2)
    torch.testing.assert_close(A.KL_ESTIMATORS.get("low_var_kl").fn(x), torch.exp(-x) + x - 1)
    assert sorted(A.BASELINES) == ["loo", "mean"] and sorted(A.NORMS) == ["none", "std"]
    assert sorted(A.AGGREGATIONS) == ["seq-mean-token-mean", "seq-mean-token-sum",
                                      "seq-mean-token-sum-norm", "token-mean"]
    assert {n: (a.count, a.needs_max_len) for n, a in A.AGGREGATIONS.items()} == {
        "token-mean": ("tokens", False), "seq-mean-token-mean": ("seqs", False),
        "seq-mean-token-sum": ("seqs", False), "seq-mean-token-sum-norm": ("seqs", True)}
    assert A.ADVANTAGE_ESTIMATORS.get("outcome") is A.group_advantages
    assert A.ADVANTAGE_ESTIMATORS.get("process") is A.process_advantages


def test_a_registered_kl_estimator_is_usable_by_name_in_the_loss():
    """Guards against the loss keeping a private copy of the names: a variant
    registered from outside must be found by kl_penalty and policy_loss alike."""
    @A.KL_ESTIMATORS.register("test_sq", "test_sq_alias")
    def _sq(x):
        return x * x

    try:
        logp, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
        torch.testing.assert_close(A.kl_penalty(logp, ref, "test_sq_alias"), (logp - ref) ** 2)
        mask = torch.ones(1, 2, dtype=torch.bool)
        _, m = A.policy_loss(logp, logp, torch.zeros(1), mask, ref_logp=ref, kl_coef=1.0,
                             kl_kind="test_sq")
        torch.testing.assert_close(m["kl"], ((logp - ref) ** 2).mean())
    finally:
        A.KL_ESTIMATORS.unregister("test_sq")
    assert "test_sq_alias" not in A.KL_ESTIMATORS.names()
