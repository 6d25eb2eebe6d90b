"""DAPO dynamic sampling (Yu et al. 2025): oversample and refill until the step holds
the requested number of groups with a reward spread.

A group whose G rewards are all equal has zero advantage for every sample, so it only
dilutes the batch. ``algorithm.dynamic_sampling`` drops such groups, then samples the
next prompts of the data stream in further rounds until ``data.prompts_per_step`` groups
with signal are held over all DP replicas, or ``algorithm.dynamic_sampling_max_rounds``
rounds have run. Extra groups from the last round are dropped, as in the paper.

The kept groups are then dealt to the DP replicas in equal shares, so every replica runs
the same number of micro-batches and optimizer steps (replicas that disagree would hang
in the gradient all-reduce). A total that does not split evenly over DP is cut to a
multiple of DP; when nothing is left, the step is empty: no update, reported as
``empty_step``, never as a non-finite step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

__all__ = ["KeptGroups", "keep_groups", "share_of_groups", "deal_groups", "need_more_groups"]


@dataclass
class KeptGroups:
    """This replica's groups with a reward spread, group-major (G samples per group)."""

    prompt_ids: list[list[int]] = field(default_factory=list)
    response_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    group_size: int = 1
    response_mask: list[list[int]] = field(default_factory=list)
    """Per sample, as ``RolloutBatch.response_mask`` (empty: single-turn, all sampled)."""

    def __len__(self) -> int:
        return len(self.response_ids)

    @property
    def num_groups(self) -> int:
        return len(self.rewards) // self.group_size

    def extend(self, other: "KeptGroups") -> None:
        self.prompt_ids += other.prompt_ids
        self.response_ids += other.response_ids
        self.logprobs += other.logprobs
        self.rewards += other.rewards
        self.response_mask += other.response_mask  # every round is multi-turn, or none is

    def groups(self, first: int, last: int) -> "KeptGroups":
        """Groups ``first..last-1`` as a new ``KeptGroups``."""
        a, b = first * self.group_size, last * self.group_size
        return KeptGroups(self.prompt_ids[a:b], self.response_ids[a:b], self.logprobs[a:b],
                          self.rewards[a:b], self.group_size, self.response_mask[a:b])


def keep_groups(batch: Any, rewards: list[float], group_size: int, tol: float = 0.0) -> KeptGroups:
    """The groups of one round's ``RolloutBatch`` whose rewards are not all equal."""
    from grpo_mega.rewards import filter_uniform_groups

    idx = filter_uniform_groups(rewards, group_size, tol).sample_indices
    mask = getattr(batch, "response_mask", [])
    return KeptGroups([batch.prompt_ids[i] for i in idx], [batch.response_ids[i] for i in idx],
                      [batch.logprobs[i] for i in idx], [float(rewards[i]) for i in idx], group_size,
                      [mask[i] for i in idx] if mask else [])


def need_more_groups(local_groups: int, target: int, rounds: int, max_rounds: int,
                     dp_group: Optional[dist.ProcessGroup], device: torch.device) -> tuple[bool, int]:
    """Whether to sample another round, and the groups kept over all replicas. The count is
    summed over DP, so every replica takes the same decision (and the same rounds).
    ``device``: the job's (``ps.device``); NCCL groups take no host tensors."""
    total = torch.tensor([local_groups], dtype=torch.int64, device=device)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(total, group=dp_group)
    total_groups = int(total)
    return total_groups < target and rounds < max_rounds, total_groups


def share_of_groups(counts: list[int], target: int, dp_rank: int) -> list[tuple[int, int, int]]:
    """Which groups replica ``dp_rank`` trains on, as ``(source replica, first, last)`` spans.

    counts: [dp] groups kept on each replica. The groups are ordered replica by replica,
    the first ``min(sum, target)`` are used, cut down to a multiple of dp, and replica r
    takes the r-th equal slice of that order. Pure, so every replica computes every share.
    """
    dp = len(counts)
    per = min(sum(counts), target) // dp  # the cut to a multiple of dp
    lo, hi = dp_rank * per, (dp_rank + 1) * per
    spans, start = [], 0
    for src, c in enumerate(counts):
        a, b = max(lo, start), min(hi, start + c)
        if a < b:
            spans.append((src, a - start, b - start))
        start += c
    return spans


def deal_groups(kept: KeptGroups, target: int, dp_rank: int,
                dp_group: Optional[dist.ProcessGroup]) -> KeptGroups:
    """This replica's equal share of the groups kept on all replicas (see ``share_of_groups``)."""
    if dp_group is None or dist.get_world_size(dp_group) == 1:
        return kept.groups(0, min(kept.num_groups, target))
    everyone: list[Optional[KeptGroups]] = [None] * dist.get_world_size(dp_group)
    dist.all_gather_object(everyone, kept, group=dp_group)
    mine = KeptGroups(group_size=kept.group_size)
    for src, first, last in share_of_groups([k.num_groups for k in everyone], target, dp_rank):
        mine.extend(everyone[src].groups(first, last))
    return mine
