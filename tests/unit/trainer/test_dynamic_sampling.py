"""DAPO dynamic sampling's bookkeeping: the refill decision and the deal of kept groups
to the DP replicas (the loop itself runs in tests/integration/test_train.py)."""
from __future__ import annotations

import itertools

import pytest

from grpo_mega.trainer.dynamic_sampling import KeptGroups, keep_groups, share_of_groups
from grpo_mega.trainer.stages import _mean_over_rounds
from tests.distributed import run_ranks


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
def test_dynamic_sampling_share_of_groups_is_equal_disjoint_and_in_order(dp):
    """Guards against a deal that gives replicas different numbers of groups (their
    micro-batch and optimizer-step counts then differ and the gradient all-reduce hangs),
    deals a group twice or drops one that fits, or takes more than the requested groups:
    for every split of kept groups over the replicas, the shares are equal, disjoint, and
    together exactly the first min(total, target) groups in replica order, cut to a
    multiple of dp."""
    for counts in itertools.product(range(4), repeat=dp):
        order = [(src, g) for src, c in enumerate(counts) for g in range(c)]
        for target in (dp, 2 * dp, 3 * dp):
            shares = [[(src, g) for src, a, b in share_of_groups(list(counts), target, r) for g in range(a, b)]
                      for r in range(dp)]
            used = min(sum(counts), target)
            used -= used % dp
            assert [len(s) for s in shares] == [used // dp] * dp, (counts, target, shares)
            assert [x for s in shares for x in s] == order[:used], (counts, target, shares)


def test_keep_groups_drops_uniform_groups_with_their_samples():
    """Guards against a filter that keeps samples of the wrong group (an index shift
    between rewards and tokens trains a response on another response's reward)."""
    class Batch:
        prompt_ids = [[g] for g in range(3) for _ in range(2)]
        response_ids = [[10 * g + j] for g in range(3) for j in range(2)]
        logprobs = [[-float(10 * g + j)] for g in range(3) for j in range(2)]

    kept = keep_groups(Batch, [1.0, 1.0, 0.0, 1.0, 0.0, 0.0], group_size=2)
    assert kept.num_groups == 1 and len(kept) == 2
    assert kept.prompt_ids == [[1], [1]] and kept.response_ids == [[10], [11]]
    assert kept.logprobs == [[-10.0], [-11.0]] and kept.rewards == [0.0, 1.0]


def test_dynamic_sampling_reward_stats_cover_every_round():
    """Guards against refill metrics that report only the first round (or average the
    standard deviations, which understates the spread between rounds)."""
    rounds = [{"reward_mean": 0.0, "reward_std": 0.0, "accuracy": 0.0, "response_len": 2.0,
               "truncated_frac": 0.0, "reward_failures": 1.0},
              {"reward_mean": 1.0, "reward_std": 0.0, "accuracy": 1.0, "response_len": 4.0,
               "truncated_frac": 1.0, "reward_failures": 2.0}]
    s = _mean_over_rounds(rounds)
    assert s["reward_mean"] == 0.5 and s["accuracy"] == 0.5 and s["response_len"] == 3.0
    assert s["reward_std"] == pytest.approx(0.5) and s["reward_failures"] == 3.0


def _dp2_refill_and_deal(rank, world):
    import torch
    import torch.distributed as dist

    from grpo_mega.trainer.dynamic_sampling import deal_groups, need_more_groups

    group = dist.new_group([0, 1])
    cpu = torch.device("cpu")
    # Replica 0 kept three groups, replica 1 none: the decision must follow the sum.
    local = 3 if rank == 0 else 0
    decisions = [need_more_groups(local, 4, 1, 4, group, cpu), need_more_groups(local, 3, 1, 4, group, cpu),
                 need_more_groups(local, 4, 4, 4, group, cpu)]
    kept = KeptGroups(group_size=2)
    for g in range(local):
        kept.extend(KeptGroups([[rank, g]] * 2, [[g, 0], [g, 1]], [[0.0], [0.0]], [0.0, 1.0], 2))
    mine = deal_groups(kept, 4, rank, group)
    return decisions, mine.prompt_ids, mine.num_groups


def test_dynamic_sampling_dp2_replicas_agree_on_rounds_and_get_equal_shares():
    """Guards against replicas that decide to refill on their own count (one samples another
    round, the other goes on to the update: the next collective hangs) and against a deal
    that leaves one replica with nothing. Real gloo at DP=2: replica 0 holds 3 groups,
    replica 1 none; both see 3 in total, and each trains on one of replica 0's groups."""
    (d0, p0, n0), (d1, p1, n1) = run_ranks(2, _dp2_refill_and_deal, timeout=120)
    assert d0 == d1 == [(True, 3), (False, 3), (False, 3)]
    assert n0 == n1 == 1
    assert p0 == [[0, 0]] * 2 and p1 == [[0, 1]] * 2
