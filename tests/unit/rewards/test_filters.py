"""Tests for grpo_mega.rewards.filters: DAPO dynamic sampling."""
from __future__ import annotations

import pytest

from grpo_mega.rewards import filter_uniform_groups


def test_filter_uniform_groups_drops_groups_without_signal():
    """Guards against dropping groups that do have signal (or keeping flat ones),
    and against sample indices that are not group-major."""
    rewards = [1, 1, 1, 0, 1, 0, 0, 0, 0, 0.5, 0.5, 0.5]
    f = filter_uniform_groups(rewards, group_size=3)
    assert (f.kept_groups, f.num_groups, f.num_dropped) == ([1], 4, 3)
    assert f.kept_samples == [3, 4, 5]
    assert filter_uniform_groups([0.0, 1e-9], 2, tol=1e-6).num_dropped == 1
    with pytest.raises(ValueError, match="do not split into groups of 4"):
        filter_uniform_groups([1, 2, 3], 4)
