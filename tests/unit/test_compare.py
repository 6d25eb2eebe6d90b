"""The suite's difference reductions (tests/compare.py) keep NaN, so a NaN anywhere fails.

Guards against the bug that hid a NaN weight behind "max diff 0.0": Python's
``max(0.0, nan)`` is 0.0, a running maximum started at 0.0 drops every NaN, and
``zip`` over lists of different lengths compares a prefix only.
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.compare import assert_close, max_abs_diff, max_abs_diff_all, worst, worst_over_ranks


def test_python_max_drops_nan_which_is_why_the_helpers_exist():
    """Positive control: the pattern the helpers replace really hides a NaN."""
    assert max(0.0, math.nan) == 0.0
    assert max([0.0, math.nan, 0.5]) == 0.5


@pytest.mark.parametrize("where", [0, 7, -1])
@pytest.mark.parametrize("side", ["actual", "expected"])
def test_a_nan_anywhere_fails_every_helper(where, side):
    """A NaN in any one element, on either side, makes every reduction NaN and every
    tolerance check fail."""
    a, b = torch.zeros(3, 4), torch.zeros(3, 4)
    (a if side == "actual" else b).view(-1)[where] = math.nan
    d = max_abs_diff(a, b)
    assert math.isnan(d) and not d <= 1e-3
    assert math.isnan(max_abs_diff_all({"x": torch.zeros(2), "w": a}, {"x": torch.zeros(2), "w": b}))
    assert math.isnan(max_abs_diff_all([torch.zeros(2), a], [torch.zeros(2), b]))
    assert math.isnan(worst([0.0, d, 1.0]))
    assert math.isnan(worst([d, 0.0]))
    ranks = [{"tp2": {"grads": 0.0}}, {"tp2": {"grads": d}}, {"tp2": {"grads": 0.0}}]
    assert math.isnan(worst_over_ranks(ranks, "grads")["tp2"])
    with pytest.raises(AssertionError):
        assert_close(a, b, atol=1.0)


def test_infinities():
    """An infinity against a finite value (or the other infinity) is infinitely far;
    equal infinities (masked log-probs) are equal."""
    ninf = torch.tensor([-math.inf, 0.0])
    assert max_abs_diff(ninf, ninf) == 0.0
    assert max_abs_diff(ninf, torch.zeros(2)) == math.inf
    assert max_abs_diff(torch.tensor([math.inf]), torch.tensor([-math.inf])) == math.inf


def test_mismatched_or_empty_comparisons_are_refused():
    """A shorter list, a missing key, a shape mismatch or nothing at all is an error,
    not a pass (``zip`` truncation, a dropped tensor)."""
    with pytest.raises(ValueError, match="lengths differ"):
        max_abs_diff_all([torch.zeros(1)], [torch.zeros(1), torch.ones(1)])
    with pytest.raises(ValueError, match="keys differ"):
        max_abs_diff_all({"a": torch.zeros(1)}, {"a": torch.zeros(1), "b": torch.ones(1)})
    with pytest.raises(ValueError, match="shapes differ"):
        max_abs_diff(torch.zeros(2), torch.zeros(3))
    with pytest.raises(ValueError, match="nothing"):
        worst([])
    with pytest.raises(ValueError, match="nothing"):
        max_abs_diff(torch.zeros(0), torch.zeros(0))


def test_values_are_right():
    """The helpers measure: max |a - b| over elements and entries, whatever the dtype."""
    a = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)
    assert max_abs_diff(a, torch.tensor([1.0, 2.5, 3.0])) == 0.5
    assert max_abs_diff_all({"a": torch.zeros(2), "b": torch.ones(2)},
                            {"a": torch.zeros(2), "b": torch.zeros(2)}) == 1.0
    assert max_abs_diff_all({"a": torch.zeros(2), "b": torch.ones(2)},
                            {"a": torch.zeros(2), "b": torch.zeros(2), "c": None}, keys=["a"]) == 0.0
    assert worst([0.1, 0.3, 0.2]) == 0.3
    assert_close(torch.ones(2), torch.ones(2, dtype=torch.float64) + 1e-7, atol=1e-6)
