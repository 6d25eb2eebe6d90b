"""The rollout layout: engine replicas on consecutive ranks, samples resharded to the trainer.

    OMP_NUM_THREADS=1 python -m pytest -q tests/unit/rollout/test_layout.py

Cost: one world-4 gloo launch with megatron's groups (about 15-25 s on 2 cores); the rest
is pure Python.
"""
from __future__ import annotations

import pytest

from grpo_mega.rollout import RolloutBatch
from grpo_mega.rollout.layout import block_ranks, prompt_slice


def _batch(prompts: list[int], n: int = 2) -> RolloutBatch:
    """A batch whose every field says which (prompt, sample) it belongs to."""
    pi = [p for p in prompts for _ in range(n)]
    js = [j for _ in prompts for j in range(n)]
    return RolloutBatch(prompt_ids=[[p] for p in pi], response_ids=[[100 * p + j] for p, j in zip(pi, js)],
                        logprobs=[[-0.5 * p - j] for p, j in zip(pi, js)], finish_reasons=["stop"] * len(pi),
                        prompt_index=pi, group_size=n, texts=[f"{p}.{j}" for p, j in zip(pi, js)],
                        stop_reasons=[None] * len(pi), seconds=float(len(prompts)))


def test_engine_blocks_are_consecutive_and_cover_the_world():
    """Guards against engine replicas laid out like megatron's (PP outermost, e.g. [0, 2]),
    which vLLM's external launcher (DP outer, TP inner) cannot run."""
    assert block_ranks(8, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert block_ranks(4, 4) == [[0, 1, 2, 3]] and block_ranks(2, 1) == [[0], [1]]
    with pytest.raises(ValueError, match="rollout.tp"):
        block_ranks(6, 4)


def test_concat_then_prompt_slice_returns_whole_groups_of_that_slice():
    """Guards against the trainer replica getting another replica's prompts, a group split
    between replicas, or a field (logprobs, texts) falling out of step with the tokens."""
    whole = RolloutBatch.concat([_batch([0, 1, 2]), _batch([3, 4, 5])])
    assert whole.prompt_index == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5] and whole.seconds == 3.0
    for index, want in ((0, [0, 1]), (1, [2, 3]), (2, [4, 5])):
        part = prompt_slice(whole, 6, index, 3)
        assert part.to_dict() == {**_batch(want).to_dict(), "seconds": 3.0}
    with pytest.raises(ValueError, match="dp size"):
        prompt_slice(whole, 6, 0, 4)
    with pytest.raises(ValueError, match="group sizes"):
        RolloutBatch.concat([_batch([0]), _batch([1], n=3)])


def _reshard_rank(rank, world):
    import torch.distributed as dist

    from grpo_mega.distributed.state import init_parallel
    from grpo_mega.rollout.layout import engine_block, gather_global

    ps = init_parallel(tp=1, pp=2)  # megatron: replica 0 = ranks {0, 2}
    group, index, replicas = engine_block(2)
    prompts = 8
    per = prompts // replicas
    mine = _batch(list(range(index * per, (index + 1) * per)))
    everything = gather_global(mine, contributes=rank == dist.get_process_group_ranks(group)[0])
    got = prompt_slice(everything, prompts, ps.dp_rank, ps.dp)
    return {"block": dist.get_process_group_ranks(group), "replica": sorted(dist.get_process_group_ranks(ps.mp_group)),
            "dp_rank": ps.dp_rank, "dp": ps.dp, "batch": got.to_dict()}


def test_samples_reach_the_trainer_replica_that_owns_their_prompts_pp2_dp2():
    """Guards against resharding that hands a trainer DP replica the samples of the engine
    block it sits in instead of its own prompts (at TP1 x PP2 x DP2 megatron's replica 0 is
    ranks {0, 2} while engine block 0 is ranks {0, 1}), and against a replica's batch
    gathered twice or not at all. Real gloo ranks and megatron groups."""
    from tests.distributed import run_ranks

    out = run_ranks(4, _reshard_rank, timeout=300)
    assert [o["block"] for o in out] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [o["replica"] for o in out] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    for o in out:
        want = _batch(list(range(4 * o["dp_rank"], 4 * o["dp_rank"] + 4))).to_dict()
        assert o["dp"] == 2 and o["batch"] == {**want, "seconds": 4.0}, o
