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

__all__ = ["engine_block", "block_ranks", "gather_global", "prompt_slice"]


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
    whole batch would give DP=2's first step prompts 0-3 and 8-11 of 16, DP=1's 0-7)."""
    if num_prompts % (count * mini_batches):
        raise ValueError(f"{num_prompts} prompts do not split into {mini_batches} mini-batch(es) over "
                         f"{count} replicas; make the prompt batch a multiple of the trainer's dp size "
                         "times its mini-batches per step")
    block = num_prompts // mini_batches
    per = block // count
    starts = [m * block + index * per for m in range(mini_batches)]
    return batch.select(p for s in starts for p in range(s, s + per))


def _check_order(batches: Sequence[RolloutBatch]) -> None:
    """Replica order must be prompt order (engine replica k samples the k-th slice)."""
    last = -1
    for b in batches:
        if b.prompt_index and b.prompt_index[0] <= last:
            raise RuntimeError("rollout batches gathered out of prompt order")
        if b.prompt_index:
            last = b.prompt_index[-1]
