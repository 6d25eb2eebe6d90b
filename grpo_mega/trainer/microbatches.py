"""How a step's rows are cut into micro-batches: a fixed row count, or a token budget.

``parallel.micro_batch_size`` (the default): consecutive slices of that many rows.

``parallel.max_tokens_per_micro_batch`` > 0: each mini-batch's rows are binned under a token
budget (prompt + response tokens of a micro-batch, what a packed micro-batch computes, bar
its tail) instead of a row count, so a micro-batch of short rows holds more of them and a
long row does not drag short ones up to its length:

1. ``bins_needed``: the fewest bins the greedy LPT partition below fits under the budget
   (from ``ceil(tokens / budget)`` up); a row longer than the budget gets a micro-batch of its
   own (single-turn rows never are: the config is refused at start-up when
   ``data.max_prompt_tokens + rollout.max_new_tokens`` exceeds the budget; multi-turn episodes
   can be).
2. The count is agreed over DP (the maximum; one all-reduce on the job's device for all
   mini-batches of the step): every replica then runs the same number of micro-batches,
   which MoE expert parallelism needs (its all-to-alls span DP ranks, one per micro-batch and
   layer) and which keeps the replicas' pipelines in step. Every stage and TP rank of a
   replica holds the same rows and computes the same plan, so PP needs nothing more.
3. ``lpt_bins``: the rows go into that many bins by greedy LPT (longest processing time first,
   Graham 1969: longest row first, each into the bin with the fewest tokens so far), which
   balances the micro-batches' tokens within the replica (across DP the replicas' shares were
   already balanced in tokens when they were dealt, ``rollout.layout.prompt_slice``). A replica with
   fewer rows than the agreed count fills the rest with *filler* micro-batches: one row with
   no trainable token (mask all False, its own buffers), which adds nothing to the loss, the
   gradient or the normalisers.
4. The batch's rows are reordered once so every bin is a run of consecutive rows, and the
   micro-batches are views of it, as with a row count.

The loss is unchanged: its normalisers are counted over the whole mini-batch, all DP ranks and
micro-batches (``algorithms.global_batch_counts``), not per micro-batch, so regrouping rows
changes no update beyond summation order (fp64 tests: ``tests/unit/trainer/test_packing.py``).
"""
from __future__ import annotations

import dataclasses
import heapq
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from grpo_mega.trainer.batch import TrainingBatch

__all__ = ["lpt_bins", "bins_needed", "agree_counts", "plan_micro_batches", "cut"]


def lpt_bins(lens: Sequence[int], k: int) -> list[list[int]]:
    """Greedy LPT partition of rows with lengths ``lens`` into ``k`` bins (some empty when
    ``k > len(lens)``): row indices per bin, ascending. Ties break on the lower row / bin index,
    so every rank holding these lengths computes the same bins."""
    heap = [(0, b) for b in range(k)]
    bins: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(range(len(lens)), key=lambda i: (-lens[i], i)):
        load, b = heapq.heappop(heap)
        bins[b].append(i)
        heapq.heappush(heap, (load + lens[i], b))
    return [sorted(b) for b in bins]


def _split(lens: Sequence[int], budget: int, k: int) -> list[list[int]]:
    """``k`` bins: each row over ``budget`` alone, the others by LPT into the rest."""
    over = [i for i, n in enumerate(lens) if n > budget]
    rest = [i for i, n in enumerate(lens) if n <= budget]
    bins = lpt_bins([lens[i] for i in rest], k - len(over))
    return [[i] for i in over] + [[rest[j] for j in b] for b in bins]


def bins_needed(lens: Sequence[int], budget: int) -> int:
    """The fewest bins with every bin under ``budget`` tokens (rows over it alone), by LPT."""
    over = sum(n > budget for n in lens)
    rest = [n for n in lens if n <= budget]
    k = max(-(-sum(rest) // budget), 1 if rest else 0)
    while rest and max(sum(rest[i] for i in b) for b in lpt_bins(rest, k)) > budget:
        k += 1
    return max(over + k, 1)


def agree_counts(counts: list[int], dp_group, device) -> list[int]:
    """The largest of each count over ``dp_group`` (None: this rank alone), one all-reduce of a
    tensor on ``device`` (NCCL takes device tensors only)."""
    if dp_group is None or not counts:
        return counts
    t = torch.tensor(counts, dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=dp_group)
    return t.tolist()


def _filler(batch: TrainingBatch) -> TrainingBatch:
    """One row of ``batch`` with nothing to train: no trainable token and its own log-prob /
    routing buffers (its writes must not reach the real row), counted as no tokens."""
    row = batch.slice(len(batch) - 1, len(batch))
    own = {k: None if getattr(row, k) is None else torch.zeros_like(getattr(row, k))
           for k in ("old_logp", "ref_logp")}
    if row.routed_experts is not None:
        own["routed_experts"] = torch.full_like(row.routed_experts, -1)
    return dataclasses.replace(row, loss_mask=torch.zeros_like(row.loss_mask), filler=True, **own)


def plan_micro_batches(batch: TrainingBatch, rows_per_mini: int, micro_batch_size: int,
                       max_tokens: int = 0, dp_group=None,
                       device: Optional[torch.device] = None
                       ) -> tuple[TrainingBatch, list[list[int]], list[int]]:
    """(the batch to slice, rows per micro-batch of each mini-batch of ``rows_per_mini`` rows
    (0: a filler), the original index of each of its rows). ``max_tokens`` 0:
    ``micro_batch_size`` rows each, the batch as given. Else the token budget of the module
    docstring, and the batch returned is ``batch`` with its rows reordered within each
    mini-batch (a copy). Collective over ``dp_group`` when ``max_tokens`` > 0. Allocate
    log-prob buffers on the returned batch, then ``cut``."""
    starts = list(range(0, len(batch), rows_per_mini))
    if max_tokens <= 0:
        return batch, [[min(micro_batch_size, n - i) for i in range(0, n, micro_batch_size)]
                       for n in (min(rows_per_mini, len(batch) - s) for s in starts)], list(range(len(batch)))
    lens = [batch.seq_lens[s:s + rows_per_mini] for s in starts]
    counts = agree_counts([bins_needed(m, max_tokens) for m in lens], dp_group, device)
    plans = [_split(m, max_tokens, k) for m, k in zip(lens, counts)]
    order = [s + i for s, bins in zip(starts, plans) for b in bins for i in b]
    return batch.take(order), [[len(b) for b in bins] for bins in plans], order


def cut(batch: TrainingBatch, sizes: list[list[int]]) -> list[list[TrainingBatch]]:
    """The micro-batches of ``plan_micro_batches``' sizes: consecutive row slices (views of
    ``batch``, so log-prob buffers allocated on it before are filled in place) and fillers."""
    minis, at = [], 0
    for mini in sizes:
        micro = []
        for n in mini:
            micro.append(batch.slice(at, at + n) if n else _filler(batch))
            at += n
        minis.append(micro)
    return minis
