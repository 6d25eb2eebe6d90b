"""Tests for grpo_mega.algorithms.advantages: GRPO z-score (sample std), Dr. GRPO,
RLOO, all-equal groups, and process-supervision advantages, hand-worked.
"""
from __future__ import annotations

import math

import pytest
import torch

from grpo_mega.algorithms import group_advantages, process_advantages


def test_group_advantages_std_uses_sample_std():
    """Guards the documented convention (Bessel std, as TRL/verl): [1,0,1,0] ->
    +-0.5/sqrt(1/3) = +-0.866, not +-1 (population std)."""
    adv = group_advantages(torch.tensor([1.0, 0, 1, 0]), 4)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1, 1, -1]) * 0.5 / math.sqrt(1 / 3))


def test_group_advantages_dr_grpo_and_loo():
    """Guards Dr. GRPO (no std division) and RLOO (baseline excludes the sample itself)."""
    r = torch.tensor([1.0, 0, 1, 0, 3, 1, 2, 2])
    torch.testing.assert_close(group_advantages(r, 4, norm="none"),
                               torch.tensor([0.5, -0.5, 0.5, -0.5, 1, -1, 0, 0]))
    loo = group_advantages(r, 4, norm="none", baseline="loo")
    torch.testing.assert_close(loo, torch.tensor([2 / 3, -2 / 3, 2 / 3, -2 / 3,
                                                  3 - 5 / 3, 1 - 7 / 3, 0, 0]))


@pytest.mark.parametrize("norm,baseline", [("std", "mean"), ("std", "loo"), ("none", "loo")])
def test_all_equal_group_rewards_give_exact_zero(norm, baseline):
    """Guards against NaN from 0/0 and against rounding noise / eps blowing up:
    0.1 repeated does not average to exactly 0.1 in fp32."""
    r = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 0.5])
    adv = group_advantages(r, 3, norm=norm, baseline=baseline)
    assert torch.equal(adv[:3], torch.zeros(3))
    assert torch.isfinite(adv).all() and adv[3:].abs().sum() > 0


def test_group_size_one_gives_zero_not_nan():
    """Guards against torch.std of a single sample (NaN) reaching the loss."""
    assert torch.equal(group_advantages(torch.tensor([1.0, 2.0]), 1), torch.zeros(2))


def test_process_advantages_hand_worked_ragged_steps():
    """Guards the DeepSeekMath process-supervision rule: normalise over the
    group's steps (sample std), token advantage = sum of normalised rewards of
    steps ending at or after it; ragged step counts, an empty row, a flat group."""
    rewards = torch.tensor([[1.0, 0.0, 0.0], [1.0, 9.0, 9.0],     # group 0 (padding = 9)
                            [0.5, 0.5, 0.5], [9.0, 9.0, 9.0]])    # group 1: all equal
    ends = torch.tensor([[1, 4, -1], [2, -1, -1],
                         [0, 2, 5], [-1, -1, -1]])
    adv = process_advantages(rewards, ends, 2, 6)
    # group 0 steps: [1, 0, 1], mean 2/3, sample std sqrt(1/3)
    hi, lo = 1 / math.sqrt(3), -2 / math.sqrt(3)
    expected = torch.tensor([
        [hi + lo, hi + lo, lo, lo, lo, 0],
        [hi, hi, hi, 0, 0, 0],
        [0, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0],
    ])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------

BAD_INPUTS = {
    "group_size_not_dividing": (lambda: group_advantages(torch.zeros(10), 4), "group_size"),
    "unknown_norm": (lambda: group_advantages(torch.zeros(4), 2, norm="zscore"), "norm"),
    "unknown_baseline": (lambda: group_advantages(torch.zeros(4), 2, baseline="median"), "baseline"),
    "rewards_2d": (lambda: group_advantages(torch.zeros(2, 2), 2), "rewards"),
    "process_group_size": (lambda: process_advantages(torch.zeros(4, 2), torch.zeros(4, 2,
                           dtype=torch.long), 3, 5), "group_size"),
    "process_end_out_of_range": (lambda: process_advantages(torch.zeros(2, 1), torch.full(
                                 (2, 1), 5), 2, 5), "step_end_index"),
    "process_end_not_increasing": (lambda: process_advantages(torch.zeros(2, 2), torch.tensor(
                                   [[3, 1], [0, -1]]), 2, 5), "step_end_index"),
}


@pytest.mark.parametrize("bad", sorted(BAD_INPUTS))
def test_bad_input_raises_value_error_naming_argument(bad):
    """Guards against groups split across prompts, typos in baseline/norm
    names falling back to a default, and malformed step layouts."""
    fn, arg = BAD_INPUTS[bad]
    with pytest.raises(ValueError, match=arg):
        fn()


def test_huge_rewards_keep_their_group_advantages_in_float64():
    """Guards against float32 arithmetic on the rewards (issue 38 finding 12): a group
    holding 1e20 squared it to inf, so its std was inf and all its advantages silently 0.
    Computed in float64 and cast back: [1e20, 0, 0, 0] -> [1.5, -0.5, -0.5, -0.5] in the
    rewards' dtype; the same holds for process advantages' step rewards."""
    from tests.compare import max_abs_diff

    adv = group_advantages(torch.tensor([1e20, 0, 0, 0, 1, 0, 1, 0], dtype=torch.float32), 4)
    assert adv.dtype == torch.float32
    want = torch.tensor([1.5, -0.5, -0.5, -0.5, *(torch.tensor([1.0, -1, 1, -1]) * 0.5 / math.sqrt(1 / 3))])
    assert max_abs_diff(adv, want) < 1e-5, adv  # eps=1e-6 is added to the std
    steps = process_advantages(torch.tensor([[1e20], [0.0], [0.0], [0.0]]), torch.tensor([[0], [0], [0], [0]]), 4, 1)
    assert steps.dtype == torch.float32 and max_abs_diff(steps, want[:4, None]) < 1e-5, steps
