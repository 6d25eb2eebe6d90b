"""DAPO dynamic sampling as a pure function: drop groups without a learning signal.

Groups whose rewards are all equal have zero GRPO advantage for every sample, so
they only dilute the batch (Yu et al. 2025, "dynamic sampling").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["GroupFilter", "filter_uniform_groups"]


@dataclass
class GroupFilter:
    kept_groups: list[int]
    """Indices of the groups (prompts) that keep a learning signal."""
    kept_samples: list[int]
    """Indices of their samples in the flat, group-major batch."""
    num_groups: int
    num_dropped: int

    @property
    def sample_indices(self) -> list[int]:
        """Alias of ``kept_samples`` (the name train.py uses)."""
        return self.kept_samples


def filter_uniform_groups(rewards: Sequence[float], group_size: int, tol: float = 0.0) -> GroupFilter:
    """Drop groups whose rewards are all equal (within ``tol``).

    rewards: [num_groups * group_size], group-major (sample ``g*group_size+j``
    is the j-th response to prompt g). Such groups have zero advantage for
    every sample, so they only dilute the batch (DAPO, "dynamic sampling").
    """
    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    num_groups = len(rewards) // group_size
    kept = []
    for g in range(num_groups):
        group = rewards[g * group_size:(g + 1) * group_size]
        if max(group) - min(group) > tol:
            kept.append(g)
    samples = [g * group_size + j for g in kept for j in range(group_size)]
    return GroupFilter(kept, samples, num_groups, num_groups - len(kept))
