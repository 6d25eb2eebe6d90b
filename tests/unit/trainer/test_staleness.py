"""Staleness accounting (``grpo_mega.trainer.staleness``): the strict per-token bound, the
drop-and-resample split, the guard before the update and the metrics, against counts
written out by hand for small batches whose versions are chosen to separate the bugs
named in each test (a token exactly at the bound, one stale token in a fresh group, a
trajectory with a gap between its versions, environment tokens of a multi-turn episode)."""
from __future__ import annotations

import pytest

from grpo_mega.rollout.types import RolloutBatch
from grpo_mega.trainer import staleness as S


def _batch(versions, group_size=2, response_mask=(), prompt_index=None):
    """A RolloutBatch with one response token per version entry (ids are the versions)."""
    n = len(versions)
    return RolloutBatch(prompt_ids=[[1, 2]] * n, response_ids=[list(v) for v in versions],
                        logprobs=[[-0.5] * len(v) for v in versions], finish_reasons=["stop"] * n,
                        prompt_index=prompt_index or [i // group_size for i in range(n)],
                        group_size=group_size, versions=[list(v) for v in versions],
                        response_mask=[list(m) for m in response_mask])


def test_staleness_versions_spanned_and_oldest_per_trajectory():
    """Guards against versions spanned miscounted: counted as distinct versions (a trajectory
    sampled across versions 4 and 6, whose version-5 update arrived with no token in between,
    spans 3, not 2), as newest - oldest (a single-version trajectory spans 1, not 0), or an
    empty trajectory counted as spanning one version."""
    assert S.versions_spanned([4, 4, 6, 6]) == 3
    assert S.versions_spanned([7, 7, 7]) == 1
    assert S.versions_spanned([3, 4, 5, 5]) == 3
    assert S.versions_spanned([]) == 0
    assert S.oldest_version([6, 4, 5]) == 4 and S.oldest_version([]) is None


def test_staleness_bound_is_strict_at_exactly_s_versions_old():
    """Guards against the off-by-one in the bound (``<=`` for ``<``): a token exactly S
    versions old (version == current - S) is within the bound and trained; one version older
    is past it. Checked in the group split and in the guard before the update."""
    current, s = 10, 2
    at_bound = _batch([[8, 9], [10], [9, 10], [10]])
    split = S.split_over_stale(at_bound, current, s)
    assert split.dropped_groups == [] and len(split.kept) == 4
    S.check_bound(at_bound, current, s)
    past = _batch([[7, 9], [10], [9, 10], [10]])
    split = S.split_over_stale(past, current, s)
    assert split.dropped_groups == [0] and split.resample == [0] and len(split.kept) == 2
    with pytest.raises(S.StalenessBoundError, match=r"sample 0 \(prompt 0\), response token 0: version 7 < 10 - 2"):
        S.check_bound(past, current, s)
    assert S.past_bound([7, 8, 9, 6], current, s) == [0, 3]


def test_staleness_bound_is_per_token_not_aggregate():
    """Guards against an aggregate bound (SkyRL's): a group whose mean version is fresh (one
    token 2 versions old among many current ones; mean staleness 0.1 <= S = 1) but which
    holds one token past the bound must be dropped, and the guard must refuse it."""
    fresh = [10] * 19
    group = [fresh, [8] + [10] * 9]            # one token 2 versions old, S = 1
    mean_staleness = sum(10 - v for r in group for v in r) / sum(len(r) for r in group)
    assert mean_staleness < 1
    b = _batch(group + [[10, 10], [9, 10]])
    split = S.split_over_stale(b, 10, 1)
    assert split.dropped_groups == [0] and split.resample == [0]
    assert split.kept.versions == [[10, 10], [9, 10]]
    with pytest.raises(S.StalenessBoundError, match="sample 1 .*response token 0: version 8"):
        S.check_bound(b, 10, 1)
    assert S.group_over_stale(group, 10, 1)


def test_staleness_split_drops_whole_groups_and_returns_their_prompts():
    """Guards against partial groups (their advantages would be computed over the survivors
    only), against resampling the wrong prompts (indices of groups rather than their
    prompt_index), and against counting the dropped groups' tokens in the histogram."""
    versions = [[5, 5], [5], [3], [5, 4],        # prompt 7: one token 2 old (S = 1): dropped
                [4, 4], [5, 5], [2, 5], [5]]     # prompt 2 kept, prompt 9 dropped
    b = _batch(versions, group_size=2, prompt_index=[4, 4, 7, 7, 2, 2, 9, 9])
    split = S.split_over_stale(b, 5, 1)
    assert split.dropped_groups == [1, 3] and split.resample == [7, 9]
    assert split.kept.prompt_index == [4, 4, 2, 2]
    assert split.kept.response_ids == [[5, 5], [5], [4, 4], [5, 5]]
    assert split.kept.logprobs == [[-0.5] * 2, [-0.5], [-0.5] * 2, [-0.5] * 2]
    st = split.stats
    # kept tokens: staleness 0: 5 tokens (5,5 | 5 | 5,5), staleness 1: 2 tokens (4,4)
    assert st.tokens_at == [5, 2] and st.groups_dropped == 2 and st.bound_violations == 0
    S.check_bound(split.kept, 5, 1)


def test_staleness_metrics_histogram_and_spans_hand_counted():
    """Guards against a wrong histogram (staleness taken as version - current, or fractions
    over the wrong total), spans averaged over empty trajectories, and bound violations not
    counted when the stats are taken over tokens past the bound."""
    versions = [[10, 10, 9], [8, 9, 10, 10], [], [10]]
    st = S.staleness_stats(versions, 10, 2, groups_dropped=3)
    m = st.metrics()
    # 8 tokens: staleness 0: 5, 1: 2, 2: 1
    assert m["staleness_frac_0"] == pytest.approx(5 / 8)
    assert m["staleness_frac_1"] == pytest.approx(2 / 8)
    assert m["staleness_frac_2"] == pytest.approx(1 / 8)
    assert set(k for k in m if k.startswith("staleness_frac_")) == {"staleness_frac_0", "staleness_frac_1",
                                                                    "staleness_frac_2"}
    assert m["staleness_mean"] == pytest.approx((2 * 1 + 1 * 2) / 8)
    # spans of the three non-empty trajectories: 2, 3, 1
    assert m["versions_spanned_mean"] == pytest.approx(2.0) and m["versions_spanned_max"] == 3.0
    assert m["stale_groups_dropped"] == 3.0 and m["staleness_bound_violations"] == 0.0
    assert S.staleness_stats([[7, 10], [6]], 10, 2).bound_violations == 2
    both = S.StalenessStats.combine([st, S.staleness_stats([[9, 9, 9, 5 + 5]], 10, 2, groups_dropped=1)])
    assert both.tokens_at == [6, 5, 1] and both.groups_dropped == 4 and both.trajectories == 4
    assert both.spanned_max == 3 and both.spanned_sum == 8


def test_staleness_empty_versions_are_current_only_in_the_synchronous_loop():
    """Guards against a batch that lost its versions (an engine that did not stamp them, a
    path that dropped the field) passing the guard of the asynchronous loop as 'all current':
    empty versions mean ``current`` at S = 0 only; at S >= 1 they are refused. Also refuses
    versions newer than the update's weights (versions counting something else)."""
    b = _batch([[1, 2], [3], [4], [5, 6]])
    b.versions = []
    split = S.split_over_stale(b, 12, 0)
    assert split.dropped_groups == [] and split.stats.tokens_at == [6]
    S.check_bound(b, 12, 0)
    for call in (lambda: S.split_over_stale(b, 12, 1), lambda: S.check_bound(b, 12, 1)):
        with pytest.raises(ValueError, match="stamp RolloutBatch.versions"):
            call()
    with pytest.raises(ValueError, match="newer than the weights"):
        S.check_bound(_batch([[3, 4]], group_size=1), 3, 1)
    with pytest.raises(ValueError, match="sample 0: 2 versions for 3 response tokens"):
        bad = _batch([[3, 3, 3]], group_size=1)
        bad.versions = [[3, 3]]
        S.check_bound(bad, 3, 0)


def test_staleness_counts_only_trained_tokens_of_multi_turn_episodes():
    """Guards against the bound judging the environment's tokens (response_mask 0: context,
    never trained on): a stale environment token must not drop the group, a stale sampled
    one must; the guard names the response position of the sampled token."""
    versions = [[9, 3, 3, 9], [9, 9], [9, 9], [9, 2]]
    masks = [[1, 0, 0, 1], [1, 1], [1, 1], [0, 1]]
    b = _batch(versions, response_mask=masks)
    split = S.split_over_stale(b, 9, 1)
    assert split.dropped_groups == [1] and split.stats.tokens_at == [4, 0]
    assert split.stats.spanned_sum == 2   # 9, 9 spans 1 in each kept trajectory
    with pytest.raises(S.StalenessBoundError, match="sample 3 .*response token 1: version 2"):
        S.check_bound(b, 9, 1)
