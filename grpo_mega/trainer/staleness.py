"""Staleness accounting for asynchronous GRPO (``algorithm.max_staleness``, S): the strict,
per-token bound, what happens to groups past it, and the metrics.

Every response token carries the policy version that sampled it (``RolloutBatch.versions``;
a version counts the weight publications of the trainer). With ``current`` the version of
the weights an update starts from, a token's staleness is ``current - version``. The bound:

    no token with ``version < current - S`` is ever trained on

per token, never as an aggregate: a group whose mean version is fresh but that holds one
token past the bound is over-stale. Only trained tokens count (``response_mask`` 1; the
environment's tokens of a multi-turn episode are context, never trained on).

Policy for over-stale groups (``split_over_stale``): the whole group is dropped (its
advantages are relative to each other, so a partial group would change the others'
advantages) and its prompt is handed back to the caller to be sampled again with the
newest weights; it is never trained on silently, and never waited for. ``check_bound`` is
the guard the trainer calls right before the update: a token past the bound there is a bug
upstream, so it raises naming the sample (the count it would log is 0 by construction).

Empty ``versions`` means every token has version ``current``: the synchronous loop, so
only accepted with S = 0. With S >= 1 the engine must stamp every token, because a batch
of one version is not necessarily the current one there.

Pure functions over host lists (no torch, no process groups): combine ``StalenessStats``
of several replicas with ``StalenessStats.combine``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from grpo_mega.rollout.types import RolloutBatch

__all__ = ["StalenessBoundError", "trained_versions", "oldest_version", "versions_spanned",
           "past_bound", "group_over_stale", "StalenessStats", "staleness_stats", "StalenessSplit",
           "split_over_stale", "check_bound"]


class StalenessBoundError(RuntimeError):
    """A token past the staleness bound reached the update (a bug upstream of it)."""


def _check_s(max_staleness: int) -> None:
    if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
        raise ValueError(f"max_staleness must be an int >= 0, got {max_staleness!r} (--algorithm.max_staleness)")


def trained_versions(batch: Any, current: int, max_staleness: int) -> list[list[int]]:
    """Per sample, the versions of its trained response tokens, in order.

    Args:
        batch: a ``RolloutBatch`` (or anything with ``response_ids`` and optionally
            ``versions`` and ``response_mask``: lists of per-token lists, one per sample;
            a missing ``versions`` counts as empty).
        current: the version of the weights the update starts from.
        max_staleness: S; empty ``versions`` (every token at ``current``) needs S = 0.

    Returns:
        [N] lists of ints; a sample's entries are those of its tokens with response_mask 1
        (all of them without a mask). Raises ValueError for versions that do not match the
        responses' lengths, empty versions at S >= 1, or a version newer than ``current``.
    """
    _check_s(max_staleness)
    responses, versions = batch.response_ids, getattr(batch, "versions", None)
    masks = getattr(batch, "response_mask", None) or [None] * len(responses)
    if not versions:
        if max_staleness:
            raise ValueError(f"the batch carries no per-token versions, but algorithm.max_staleness="
                             f"{max_staleness}: the engine must stamp RolloutBatch.versions in the "
                             "asynchronous loop (empty means 'all current', the synchronous loop)")
        versions = [[current] * len(r) for r in responses]
    if len(versions) != len(responses):
        raise ValueError(f"versions has {len(versions)} samples, the batch {len(responses)}")
    out = []
    for i, (v, r, m) in enumerate(zip(versions, responses, masks)):
        if len(v) != len(r):
            raise ValueError(f"sample {i}: {len(v)} versions for {len(r)} response tokens")
        if m is not None and len(m) != len(r):
            raise ValueError(f"sample {i}: {len(m)} response_mask entries for {len(r)} response tokens")
        kept = list(v) if m is None else [x for x, keep in zip(v, m) if keep]
        newer = [x for x in kept if x > current]
        if newer:
            raise ValueError(f"sample {i}: token version {max(newer)} is newer than the weights the update "
                             f"starts from (version {current}); versions must count the trainer's "
                             "weight publications")
        out.append(kept)
    return out


def oldest_version(versions: Sequence[int]) -> Optional[int]:
    """The oldest version of one trajectory's tokens [T]; None without tokens."""
    return min(versions) if len(versions) else None


def versions_spanned(versions: Sequence[int]) -> int:
    """How many policy versions one trajectory's tokens [T] span: newest - oldest + 1 (1 for
    a trajectory of one version, 3 for versions 4, 4, 6; 0 without tokens)."""
    return max(versions) - min(versions) + 1 if len(versions) else 0


def past_bound(versions: Sequence[int], current: int, max_staleness: int) -> list[int]:
    """Positions of the tokens [T] of one trajectory past the bound: version < current - S."""
    return [t for t, v in enumerate(versions) if v < current - max_staleness]


def group_over_stale(group: Sequence[Sequence[int]], current: int, max_staleness: int) -> bool:
    """Whether any token of any trajectory of one group [n][T_i] is past the bound."""
    return any(past_bound(v, current, max_staleness) for v in group)


@dataclass
class StalenessStats:
    """Counts behind the staleness metrics of the trained samples (see ``metrics``)."""

    max_staleness: int
    tokens_at: list[int]
    """[S + 1]: trained tokens at staleness 0, 1, ..., S."""
    trajectories: int = 0
    """Trained samples with at least one trained token."""
    spanned_sum: int = 0
    spanned_max: int = 0
    groups_dropped: int = 0
    bound_violations: int = 0
    """Tokens past the bound among the trained ones (0 by construction)."""

    @classmethod
    def combine(cls, parts: Sequence["StalenessStats"]) -> "StalenessStats":
        """The counts of several replicas (or rounds) together."""
        if not parts:
            raise ValueError("combine of no StalenessStats")
        s = parts[0].max_staleness
        if any(p.max_staleness != s for p in parts):
            raise ValueError("combine of StalenessStats with different max_staleness")
        return cls(s, [sum(c) for c in zip(*(p.tokens_at for p in parts))],
                   sum(p.trajectories for p in parts), sum(p.spanned_sum for p in parts),
                   max(p.spanned_max for p in parts), sum(p.groups_dropped for p in parts),
                   sum(p.bound_violations for p in parts))

    def metrics(self) -> dict[str, float]:
        """``staleness_frac_<k>`` (k = 0..S: share of the trained tokens sampled k versions
        before the update's weights), ``staleness_mean``, ``versions_spanned_mean`` /
        ``_max`` (per trajectory), ``stale_groups_dropped``, ``staleness_bound_violations``."""
        tokens = sum(self.tokens_at)
        out = {f"staleness_frac_{k}": c / tokens if tokens else 0.0 for k, c in enumerate(self.tokens_at)}
        out["staleness_mean"] = sum(k * c for k, c in enumerate(self.tokens_at)) / tokens if tokens else 0.0
        out["versions_spanned_mean"] = self.spanned_sum / self.trajectories if self.trajectories else 0.0
        out["versions_spanned_max"] = float(self.spanned_max)
        out["stale_groups_dropped"] = float(self.groups_dropped)
        out["staleness_bound_violations"] = float(self.bound_violations)
        return out


def staleness_stats(versions: Sequence[Sequence[int]], current: int, max_staleness: int,
                    groups_dropped: int = 0) -> StalenessStats:
    """Counts over the trained versions [N][T_i] (``trained_versions``) of the samples that
    will be trained; tokens past the bound are counted as violations, not in the histogram."""
    _check_s(max_staleness)
    st = StalenessStats(max_staleness, [0] * (max_staleness + 1), groups_dropped=groups_dropped)
    for v in versions:
        for x in v:
            k = current - x
            if 0 <= k <= max_staleness:
                st.tokens_at[k] += 1
            else:
                st.bound_violations += 1
        if len(v):
            span = versions_spanned(v)
            st.trajectories += 1
            st.spanned_sum += span
            st.spanned_max = max(st.spanned_max, span)
    return st


@dataclass
class StalenessSplit:
    """A batch cut into the groups within the bound and the over-stale ones."""

    kept: RolloutBatch
    """The groups whose every trained token is within the bound, in batch order."""
    dropped_groups: list[int] = field(default_factory=list)
    """Indices (in the input batch, group-major) of the over-stale groups."""
    resample: list[int] = field(default_factory=list)
    """``prompt_index`` of each dropped group: the caller samples these prompts again."""
    stats: Optional[StalenessStats] = None
    """Counts over ``kept`` (and the groups dropped)."""


def split_over_stale(batch: RolloutBatch, current: int, max_staleness: int) -> StalenessSplit:
    """Drop the over-stale groups of ``batch`` (group-major, ``batch.group_size`` samples per
    group): a group goes when any of its trained tokens has version < current - S.

    Returns the kept groups as a batch, the dropped groups and their prompts to sample
    again, and the staleness counts of what is kept. See the module docstring."""
    n = batch.group_size
    if n < 1 or len(batch) % n:
        raise ValueError(f"batch of {len(batch)} samples is not whole groups of {n}")
    versions = trained_versions(batch, current, max_staleness)
    keep, dropped, resample = [], [], []
    for g in range(len(batch) // n):
        rows = range(g * n, (g + 1) * n)
        if group_over_stale([versions[i] for i in rows], current, max_staleness):
            dropped.append(g)
            resample.append(batch.prompt_index[g * n])
        else:
            keep += rows
    stats = staleness_stats([versions[i] for i in keep], current, max_staleness, len(dropped))
    return StalenessSplit(batch.take(keep), dropped, resample, stats)


def check_bound(batch: Any, current: int, max_staleness: int) -> None:
    """The guard right before the update: raise ``StalenessBoundError`` naming the first
    sample, token, version and bound if any trained token of ``batch`` (a ``RolloutBatch``,
    see ``trained_versions``) has version < current - S. Returns nothing when every token is
    within the bound; raises ValueError for a batch without versions at S >= 1."""
    versions = trained_versions(batch, current, max_staleness)
    bad = [(i, past_bound(v, current, max_staleness)) for i, v in enumerate(versions)]
    bad = [(i, pos) for i, pos in bad if pos]
    if bad:
        i, pos = bad[0]
        mask = (getattr(batch, "response_mask", None) or [None] * len(versions))[i]
        token = pos[0] if mask is None else [t for t, keep in enumerate(mask) if keep][pos[0]]
        prompt = getattr(batch, "prompt_index", None)
        raise StalenessBoundError(
            f"sample {i}{f' (prompt {prompt[i]})' if prompt else ''}, response token {token}: version "
            f"{versions[i][pos[0]]} < {current} - {max_staleness} (the update's weights minus "
            f"algorithm.max_staleness); {sum(len(p) for _, p in bad)} token(s) in {len(bad)} sample(s) "
            "past the bound would be trained. Over-stale groups must be dropped before the update "
            "(trainer.staleness.split_over_stale)")
