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


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_prompt_slice_gives_each_mini_batch_the_same_prompts_at_every_dp(dp):
    """Guards against a deal that makes a step with several mini-batches depend on the DP
    size (the known-limits bug this replaced: each replica held a contiguous slice and cut
    its mini-batches from it, so DP=2's first optimizer step saw prompts 0-3 and 8-11 of
    16 where DP=1 saw 0-7). Each replica cuts its rows into equal mini-batches in order, as
    ``stages.logprobs`` does; the j-th ones of all replicas together must be prompts
    [4j, 4j+4) of the step, each once, with whole groups, at every DP size."""
    prompts, minis, n = 16, 4, 2
    whole = _batch(list(range(prompts)), n=n)
    seen = [[] for _ in range(minis)]
    for index in range(dp):
        part = prompt_slice(whole, prompts, index, dp, mini_batches=minis)
        rows = len(part) // minis
        for j in range(minis):
            cut = part.prompt_index[j * rows:(j + 1) * rows]
            assert all(cut.count(p) == n for p in set(cut)), ("a group split", dp, index, j, cut)
            seen[j] += cut
    assert [sorted(set(s)) for s in seen] == [list(range(4 * j, 4 * j + 4)) for j in range(minis)], (dp, seen)
    assert all(len(s) == 4 * n for s in seen)
    assert prompt_slice(whole, prompts, 1, 2).prompt_index == [p for p in range(8, 16) for _ in range(n)]
    with pytest.raises(ValueError, match="mini-batch"):
        prompt_slice(whole, prompts, 0, 8, mini_batches=4)


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


def test_prompt_slice_balances_packed_tokens_across_dp_with_whole_groups():
    """Guards against DP replicas dealt contiguous prompts whatever their lengths (the
    long-tailed step's slowest replica sets the step time: here the contiguous deal gives
    replica 0 prompts 0, 1, 4, 5, 230 tokens against 74), and against a balanced deal that splits a group, changes the replicas' group counts, moves a
    prompt into another mini-batch, or differs between ranks (it must be a function of the
    global batch). Packed micro-batches compute tokens, not rows, so tokens are what must be
    balanced."""
    from grpo_mega.rollout.layout import balanced_shares

    n, prompts, minis = 2, 8, 2
    lens = {0: 40, 1: 40, 2: 1, 3: 1, 4: 1, 5: 30, 6: 30, 7: 1}
    b = _batch(list(range(prompts)), n=n)
    b.response_ids = [[7] * lens[p] for p in b.prompt_index]
    parts = [prompt_slice(b, prompts, i, 2, mini_batches=minis) for i in range(2)]
    load = [sum(len(x) + len(y) for x, y in zip(p.prompt_ids, p.response_ids)) for p in parts]
    # a group of prompt p holds 2 x (1 + lens[p]) tokens; the contiguous deal would give
    # replica 0 prompts 0, 1, 4, 5 (230 tokens) and replica 1 prompts 2, 3, 6, 7 (74)
    assert load == [152, 152], load
    for j in range(minis):
        got = sorted(set(parts[0].prompt_index[j * 4:(j + 1) * 4] + parts[1].prompt_index[j * 4:(j + 1) * 4]))
        assert got == list(range(4 * j, 4 * j + 4)), (j, got)
    for p in parts:
        assert all(p.prompt_index.count(q) == n for q in set(p.prompt_index)) and len(p) == 4 * n
    assert balanced_shares([5, 5, 5, 5], 2) == [[0, 1], [2, 3]]  # equal lengths: the plain deal
    assert balanced_shares([9, 1, 8, 2, 1, 1], 3) == [[0, 1], [2, 3], [4, 5]]
    assert balanced_shares([9, 8, 1, 1], 2) == [[0, 3], [1, 2]]
