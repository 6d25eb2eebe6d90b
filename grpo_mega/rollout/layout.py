"""Where rollout engines sit, independent of the trainer's layout, and how samples move.

What: an engine replica is a block of ``etp`` consecutive global ranks
(:func:`engine_block`): vLLM's external launcher lays its ranks out DP-outer /
TP-inner, so only consecutive blocks work there, while megatron puts PP
outermost and its model-parallel groups are then not consecutive (TP2xPP2xDP2:
replica 0 is ranks 0,1,4,5). So the engines get their own groups, and the
samples are moved to the trainer afterwards: engine replica k samples prompts
[k*P/R, (k+1)*P/R) of the global batch (R = world / etp replicas), every engine
replica's batch is gathered on every rank (:func:`gather_global`), and each
trainer DP replica takes its own prompt slice (:func:`prompt_slice`).

Sampling does not depend on the layout: each request's seed is a function of
(seed, step, global prompt index), see ``samples.request_seed``.

Cost: one ``all_gather_object`` of the step's token lists per rollout; each
rank then holds the global batch's token ids (about 10 MB for 512 samples of
3k tokens), never tensors.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from grpo_mega.rollout.types import RolloutBatch

__all__ = ["engine_block", "block_ranks", "gather_global", "prompt_slice", "balanced_shares"]


def block_ranks(world: int, etp: int) -> list[list[int]]:
    """The engine replicas' ranks: ``[[0..etp-1], [etp..2etp-1], ...]``."""
    if etp < 1 or world % etp:
        raise ValueError(f"world size {world} is not divisible by rollout tp={etp} (--rollout.tp)")
    return [list(range(k * etp, (k + 1) * etp)) for k in range(world // etp)]


def engine_block(etp: int) -> tuple[Any, int, int]:
    """(process group of this rank's engine replica, replica index, number of replicas).

    Collective over the world: every rank creates every block's group (torch's
    ``new_group`` rule). Without a torch.distributed world: (None, 0, 1)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if etp != 1:
            raise ValueError(f"rollout tp={etp} needs a torch.distributed world of at least {etp} ranks")
        return None, 0, 1
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = None
    for ranks in block_ranks(world, etp):
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine, rank // etp, world // etp


def gather_global(batch: Optional[RolloutBatch], contributes: bool) -> RolloutBatch:
    """Every engine replica's batch, concatenated in replica order (= global prompt
    order), on every rank. ``contributes``: this rank sends its replica's batch (one
    rank per replica; the others send nothing). Collective over the world."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return batch
    boxes: list = [None] * dist.get_world_size()
    dist.all_gather_object(boxes, batch.to_dict() if contributes else None)
    batches = [RolloutBatch.from_dict(b) for b in boxes if b is not None]
    _check_order(batches)
    return RolloutBatch.concat(batches)


def prompt_slice(batch: RolloutBatch, num_prompts: int, index: int, count: int,
                 mini_batches: int = 1) -> RolloutBatch:
    """Replica ``index`` of ``count``'s samples of a global batch of ``num_prompts`` prompts
    (``prompt_index`` stays global): of each of the step's ``mini_batches`` consecutive
    blocks of prompts, its ``index``-th share, block after block. Each optimizer step then
    sees the same prompts at every DP size: a replica cuts its mini-batches from its rows in
    order, and its j-th one is its share of the step's j-th block (a contiguous slice of the
    whole batch would give DP=2's first step prompts 0-3 and 8-11 of 16, DP=1's 0-7).

    Within a block, the shares are balanced in tokens (:func:`balanced_shares`): every
    replica gets the same number of whole groups, and the replica with the most tokens, whose
    update the others wait for, gets as few as the partition can give it. The loss is
    normalised over the whole block on all replicas, so which replica trains which group
    changes no update beyond summation order."""
    if num_prompts % (count * mini_batches):
        raise ValueError(f"{num_prompts} prompts do not split into {mini_batches} mini-batch(es) over "
                         f"{count} replicas; make the prompt batch a multiple of the trainer's dp size "
                         "times its mini-batches per step")
    block = num_prompts // mini_batches
    tokens = [0] * num_prompts
    for p, a, b in zip(batch.prompt_index, batch.prompt_ids, batch.response_ids):
        if 0 <= p < num_prompts:
            tokens[p] += len(a) + len(b)
    mine: list[int] = []
    for m in range(mini_batches):
        mine += [m * block + q for q in balanced_shares(tokens[m * block:(m + 1) * block], count)[index]]
    return batch.select(mine)


def balanced_shares(tokens: Sequence[int], count: int) -> list[list[int]]:
    """Split prompts ``0..len(tokens)-1`` (``tokens[p]``: the tokens of prompt p's group)
    into ``count`` shares of equal size, ascending indices each. The contiguous split unless
    greedy LPT under a cardinality cap (longest group first, into the share with the fewest
    tokens that still has room; Graham 1969, with the equal-count constraint verl's
    sequence-length balancing also keeps) lowers the heaviest share's tokens: equal lengths
    keep the plain deal. Deterministic (ties on the lower index), so every rank, holding the
    same global batch, computes the same shares."""
    n = len(tokens)
    per = n // count
    contiguous = [list(range(k * per, (k + 1) * per)) for k in range(count)]
    if count == 1 or per == 0:
        return contiguous
    loads, shares = [0] * count, [[] for _ in range(count)]
    for p in sorted(range(n), key=lambda p: (-tokens[p], p)):
        k = min((k for k in range(count) if len(shares[k]) < per), key=lambda k: (loads[k], k))
        shares[k].append(p)
        loads[k] += tokens[p]
    heaviest = max(sum(tokens[p] for p in s) for s in contiguous)
    return [sorted(s) for s in shares] if max(loads) < heaviest else contiguous


def _check_order(batches: Sequence[RolloutBatch]) -> None:
    """Replica order must be prompt order (engine replica k samples the k-th slice)."""
    last = -1
    for b in batches:
        if b.prompt_index and b.prompt_index[0] <= last:
            raise RuntimeError("rollout batches gathered out of prompt order")
        if b.prompt_index:
            last = b.prompt_index[-1]
