"""Tests for grpo_mega.algorithms: exactness at TP=1/2/4, global normalisation, edge cases.

Multi-rank checks run on real gloo ranks (tests/distributed.py). Each launch
costs seconds, so ONE launch of 4 ranks runs every multi-rank check (TP=4 on
the world; TP=2, DP=2, TP2xDP2 and 1-rank groups on subgroups) and returns
{check name: None if it passed, else the failure message}; the small tests
below each assert one entry. TP=1 runs in-process with tp_group=None.

    OMP_NUM_THREADS=1 python -m pytest -q tests/unit/algorithms/test_vocab_parallel.py

Tolerance "1e-6" for fp32 inputs means |ours - fp64| <= 1e-6 + 1e-6 |fp64|:
an fp32 result of magnitude ~10 cannot be closer than its own rounding.
"""
from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.distributed as dist

from grpo_mega.algorithms import (
    AGGREGATIONS,
    aggregate,
    global_batch_counts,
    group_advantages,
    kl_penalty,
    policy_loss,
    process_advantages,
    vocab_parallel_entropy,
    vocab_parallel_kl,
    vocab_parallel_logprobs,
)
from tests.distributed import run_ranks

V = 96          # divisible by 1, 2 and 4
B, L = 4, 6     # logits [B, L, V/tp]: a 2-D leading shape on purpose
LENGTHS = [6, 4, 0, 5]  # ragged, with an empty response
FP32 = dict(atol=1e-6, rtol=1e-6)
LOSS_KW = dict(clip_low=0.2, clip_high=0.28, dual_clip=1.5, kl_coef=0.1, kl_kind="k3", tis_cap=1.2)
MODES = sorted(AGGREGATIONS)
MAX_LEN = 8


# ---------------------------------------------------------------------------
# data and float64 references (independent of the code under test)
# ---------------------------------------------------------------------------

def _case(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, L, V, generator=g) * 1.5
    ref_logits = logits + 0.5 * torch.randn(B, L, V, generator=g)
    # 37 is coprime to 96: the 24 targets spread over every shard at TP=2 and 4.
    targets = ((torch.arange(B * L) * 37 + 5) % V).view(B, L)
    logp64 = torch.log_softmax(logits.double(), -1).gather(-1, targets[..., None]).squeeze(-1)
    old_logp = (logp64 + 0.3 * torch.randn(B, L, generator=g, dtype=torch.float64)).float()
    rollout_logp = old_logp + 0.2 * torch.randn(B, L, generator=g)
    mask = torch.arange(L)[None, :] < torch.tensor(LENGTHS)[:, None]
    return dict(logits=logits, ref_logits=ref_logits, targets=targets, old_logp=old_logp,
                rollout_logp=rollout_logp, advantages=torch.randn(B, generator=g), mask=mask,
                weights=torch.randn(B, L, generator=g))


def _ref_agg(tok, mask, mode, max_len=None):
    rows = [tok[i][mask[i]] for i in range(tok.shape[0])]
    nonempty = [r for r in rows if r.numel()]
    if mode == "token-mean":
        return torch.cat(rows).sum() / max(sum(r.numel() for r in rows), 1)
    if mode == "seq-mean-token-mean":
        return sum(r.mean() for r in nonempty) / len(nonempty)
    if mode == "seq-mean-token-sum":
        return sum(r.sum() for r in nonempty) / len(nonempty)
    assert mode == "seq-mean-token-sum-norm"
    return sum(r.sum() for r in nonempty) / (len(nonempty) * max_len)


def _ref_loss(logp, old, adv, mask, ref, rollout, *, clip_low, clip_high, dual_clip, kl_coef,
              kl_kind, tis_cap, mode="token-mean", max_len=None):
    """GRPO loss written as the objective to maximise, negated; all float64."""
    assert kl_kind == "k3"
    adv = adv[:, None].expand_as(logp) if adv.dim() == 1 else adv
    ratio = torch.exp(logp - old)
    surr = torch.minimum(ratio * adv, ratio.clamp(1 - clip_low, 1 + clip_high) * adv)
    if dual_clip is not None:
        surr = torch.where(adv < 0, torch.maximum(surr, dual_clip * adv), surr)
    if rollout is not None:
        surr = surr * torch.exp(old - rollout).clamp(max=tis_cap)
    d = ref - logp
    tok = -surr + kl_coef * (torch.exp(d) - d - 1)
    return _ref_agg(tok, mask, mode, max_len)


def _reference(logits, ref_logits, targets, c):
    """fp64 full-vocab values and grads w.r.t. the FULL logits."""
    z = logits.double().requires_grad_()
    logq = torch.log_softmax(ref_logits.double(), -1)
    lsm = torch.log_softmax(z, -1)
    p = lsm.exp()
    vals = dict(
        logprobs=lsm.gather(-1, targets[..., None]).squeeze(-1),
        entropy=-(p * lsm).sum(-1),
        kl=(p * (lsm - logq)).sum(-1),
    )
    w = c["weights"].double()
    out = {}
    for name, v in vals.items():
        grad, = torch.autograd.grad((v * w).sum(), z, retain_graph=True)
        out[name] = (v.detach(), grad)
    ref_logp = logq.gather(-1, targets[..., None]).squeeze(-1)
    loss = _ref_loss(vals["logprobs"], c["old_logp"].double(), c["advantages"].double(),
                     c["mask"], ref_logp, c["rollout_logp"].double(), **LOSS_KW)
    out["policy_loss"] = (loss.detach(), torch.autograd.grad(loss, z)[0])
    out["entropy_mean"] = vals["entropy"].detach()[c["mask"]].mean()
    return out


# ---------------------------------------------------------------------------
# checks run on each rank (or in-process for TP=1)
# ---------------------------------------------------------------------------

def _close(out, name, actual, expected, **tol):
    try:
        torch.testing.assert_close(actual.detach().double(), expected.double(), **tol)
        out[name] = None
    except AssertionError as e:
        out[name] = str(e)


def _equal(out, name, a, b):
    out[name] = None if torch.equal(a, b) else f"not bitwise equal, max diff {(a - b).abs().max()}"


def _shard(t, group):
    tp = 1 if group is None else dist.get_world_size(group)
    r = 0 if group is None else dist.get_rank(group)
    vs = t.shape[-1] // tp
    return t[..., r * vs:(r + 1) * vs]


def _ours(logits, ref_logits, c, group, chunk_size=None):
    """Our values and shard grads for the same weighted sums as _reference."""
    out = {}
    fns = dict(
        logprobs=lambda x: vocab_parallel_logprobs(x, c["targets"], group, chunk_size=chunk_size),
        entropy=lambda x: vocab_parallel_entropy(x, group, chunk_size=chunk_size),
        kl=lambda x: vocab_parallel_kl(x, _shard(ref_logits, group), group, chunk_size=chunk_size),
    )
    for name, fn in fns.items():
        leaf = _shard(logits, group).clone().requires_grad_()
        v = fn(leaf)
        (v * c["weights"]).sum().backward()
        out[name] = (v.detach(), leaf.grad)
    return out


def _tp_checks(group) -> dict:
    c = _case()
    res = {}
    rank_shard = _shard(torch.arange(V), group)
    tp = V // rank_shard.numel()
    owners = torch.unique(c["targets"] // (V // tp))
    res["targets_cover_every_shard"] = (None if owners.tolist() == list(range(tp))
                                        else f"targets hit shards {owners.tolist()}")

    ref = _reference(c["logits"], c["ref_logits"], c["targets"], c)
    ours = _ours(c["logits"], c["ref_logits"], c, group)
    for name in ("logprobs", "entropy", "kl"):
        _close(res, f"{name}_value", ours[name][0], ref[name][0], **FP32)
        _close(res, f"{name}_grad", ours[name][1], _shard(ref[name][1], group), **FP32)

    # the reference logits get no gradient through the KL
    leaf, ref_leaf = (_shard(c["logits"], group).clone().requires_grad_(),
                      _shard(c["ref_logits"], group).clone().requires_grad_())
    vocab_parallel_kl(leaf, ref_leaf, group).sum().backward()
    res["kl_ref_has_no_grad"] = None if ref_leaf.grad is None else "ref_logits_shard got a gradient"

    # full GRPO loss through vocab-parallel log-probs
    leaf = _shard(c["logits"], group).clone().requires_grad_()
    logp = vocab_parallel_logprobs(leaf, c["targets"], group)
    with torch.no_grad():
        ref_logp = vocab_parallel_logprobs(_shard(c["ref_logits"], group), c["targets"], group)
        ent = vocab_parallel_entropy(leaf, group)
    loss, metrics = policy_loss(logp, c["old_logp"], c["advantages"], c["mask"], ref_logp=ref_logp,
                                rollout_logp=c["rollout_logp"], entropy=ent, **LOSS_KW)
    loss.backward()
    _close(res, "policy_loss_value", loss, ref["policy_loss"][0], **FP32)
    _close(res, "policy_loss_grad", leaf.grad, _shard(ref["policy_loss"][1], group), **FP32)
    _close(res, "policy_loss_entropy_metric", metrics["entropy"], ref["entropy_mean"], **FP32)

    # chunking changes memory, never results
    chunked = _ours(c["logits"], c["ref_logits"], c, group, chunk_size=5)
    for name in ("logprobs", "entropy", "kl"):
        _equal(res, f"chunked_{name}_value", chunked[name][0], ours[name][0])
        _equal(res, f"chunked_{name}_grad", chunked[name][1], ours[name][1])

    # bf16 logits: fp32 math inside, so values stay tight; grads come back in bf16
    bf, bf_ref = c["logits"].bfloat16(), c["ref_logits"].bfloat16()
    ref_bf = _reference(bf, bf_ref, c["targets"], c)
    ours_bf = _ours(bf, bf_ref, c, group)
    for name in ("logprobs", "entropy", "kl"):
        v, g = ours_bf[name]
        ok = v.dtype == torch.float32 and g.dtype == torch.bfloat16
        res[f"bf16_{name}_dtypes"] = None if ok else f"value {v.dtype}, grad {g.dtype}"
        _close(res, f"bf16_{name}_value", v, ref_bf[name][0], atol=1e-5, rtol=1e-5)
        _close(res, f"bf16_{name}_grad", g, _shard(ref_bf[name][1], group), atol=1e-5, rtol=1e-2)

    # ids are global: V/tp is a valid id at TP>1 but V never is
    try:
        vocab_parallel_logprobs(_shard(c["logits"], group), torch.full((B, L), V), group)
        res["global_vocab_bound_rejected"] = "target id V was accepted"
    except ValueError as e:
        res["global_vocab_bound_rejected"] = None if "targets" in str(e) else str(e)
    return res


def _split_loss(logp_full, c, mode, row_slices, dp_group):
    """Sum of micro-batch losses over row_slices with global counts over dp_group."""
    masks = [c["mask"][s] for s in row_slices]
    tokens, seqs = global_batch_counts(masks, dp_group)
    total = 0.0
    for s in row_slices:
        loss, _ = policy_loss(logp_full[s], c["old_logp"][s], c["advantages"][s], c["mask"][s],
                              ref_logp=c["ref_logp"][s], rollout_logp=c["rollout_logp"][s],
                              agg=mode, max_len=MAX_LEN, global_tokens=tokens, global_seqs=seqs,
                              **LOSS_KW)
        total = total + loss
    return total


def _batch_case(seed=1, rows=8, cols=7):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 3, 0, 5, 1, 7, 2, 4])[:rows]
    mask = torch.arange(cols)[None, :] < lengths[:, None]
    logp = -torch.rand(rows, cols, generator=g) * 3
    return dict(logp=logp, old_logp=logp + 0.3 * torch.randn(rows, cols, generator=g),
                ref_logp=logp + 0.2 * torch.randn(rows, cols, generator=g),
                rollout_logp=logp + 0.2 * torch.randn(rows, cols, generator=g),
                advantages=torch.randn(rows, generator=g), mask=mask)


def _dp_checks(dp_group) -> dict:
    """DP=2, 2 micro-batches per rank, vs one rank with the whole batch."""
    c = _batch_case()
    res = {}
    per = c["logp"].shape[0] // dist.get_world_size(dp_group)
    lo = dist.get_rank(dp_group) * per
    for mode in MODES:
        whole = c["logp"].clone().requires_grad_()
        loss_whole = _split_loss(whole, c, mode, [slice(None)], None)
        loss_whole.backward()

        leaf = c["logp"].clone().requires_grad_()
        mbs = [slice(lo, lo + per // 2), slice(lo + per // 2, lo + per)]
        loss = _split_loss(leaf, c, mode, mbs, dp_group)
        loss.backward()
        total, grad = loss.detach().clone(), leaf.grad.clone()
        dist.all_reduce(total, group=dp_group)
        dist.all_reduce(grad, group=dp_group)  # DP sums gradients
        _close(res, f"dp_loss_{mode}", total, loss_whole, **FP32)
        _close(res, f"dp_grad_{mode}", grad, whole.grad, **FP32)
    return res


def _tp2dp2_checks(tp_group, dp_group) -> dict:
    """TP=2 x DP=2, one row per micro-batch, vs the fp64 full-vocab whole-batch loss."""
    dp_rank = dist.get_rank(dp_group)
    c = _case()
    res = {}
    z = c["logits"].double().requires_grad_()
    logp64 = torch.log_softmax(z, -1).gather(-1, c["targets"][..., None]).squeeze(-1)
    ref_logp64 = torch.log_softmax(c["ref_logits"].double(), -1).gather(
        -1, c["targets"][..., None]).squeeze(-1)
    c["ref_logp"] = ref_logp64.float()
    for mode in ("token-mean", "seq-mean-token-mean"):
        loss64 = _ref_loss(logp64, c["old_logp"].double(), c["advantages"].double(), c["mask"],
                           ref_logp64, c["rollout_logp"].double(), mode=mode, **LOSS_KW)
        grad64, = torch.autograd.grad(loss64, z, retain_graph=True)
        leaf = _shard(c["logits"], tp_group).clone().requires_grad_()
        rows = [slice(2 * dp_rank, 2 * dp_rank + 1), slice(2 * dp_rank + 1, 2 * dp_rank + 2)]
        logp = vocab_parallel_logprobs(leaf, c["targets"], tp_group)
        loss = _split_loss(logp, c, mode, rows, dp_group)
        loss.backward()
        total, grad = loss.detach().clone(), leaf.grad.clone()
        dist.all_reduce(total, group=dp_group)
        dist.all_reduce(grad, group=dp_group)
        _close(res, f"loss_{mode}", total, loss64, **FP32)
        _close(res, f"grad_{mode}", grad, _shard(grad64, tp_group), **FP32)
    return res


def _real_group_of_one_checks(group) -> dict:
    """A real process group of size 1 must behave exactly like tp_group=None."""
    c = _case()
    a = _ours(c["logits"], c["ref_logits"], c, group)
    b = _ours(c["logits"], c["ref_logits"], c, None)
    res = {}
    for name in a:
        _equal(res, f"{name}_value", a[name][0], b[name][0])
        _equal(res, f"{name}_grad", a[name][1], b[name][1])
    return res


def _prefixed(prefix, d):
    return {f"{prefix}/{k}": v for k, v in d.items()}


WORLD = 4  # one launch: TP=4 on the world, TP=2 / DP=2 / size-1 groups inside it


def _rank_checks(rank, world):
    assert world == WORLD
    # Every rank creates every group, in the same order (torch.distributed's rule).
    tp2 = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    dp2 = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    single = [dist.new_group([r]) for r in range(world)][rank]
    res = _prefixed("tp4", _tp_checks(dist.group.WORLD))
    res.update(_prefixed("tp2", _tp_checks(tp2)))
    res.update(_prefixed("dp", _dp_checks(dp2)))
    res.update(_prefixed("tp2dp2", _tp2dp2_checks(tp2, dp2)))
    res.update(_prefixed("group1", _real_group_of_one_checks(single)))
    return res


@functools.lru_cache(maxsize=None)
def _launch_once():
    """(merged results, None) or (None, failure text); a failed launch is not retried."""
    try:
        per_rank = run_ranks(WORLD, _rank_checks)
    except AssertionError as e:
        return None, str(e)
    merged: dict = {}
    for rank, res in enumerate(per_rank):
        for k, v in res.items():
            if k not in merged or (merged[k] is None and v is not None):
                merged[k] = None if v is None else f"rank {rank}: {v}"
    return merged, None


def _launch() -> dict:
    merged, error = _launch_once()
    assert error is None, error
    return merged


def _section(results, prefix):
    return {k[len(prefix) + 1:]: v for k, v in results.items() if k.startswith(prefix + "/")}


def _ok(results, *names):
    for n in names:
        assert n in results, f"check {n!r} did not run"
        assert results[n] is None, f"{n}: {results[n]}"


@pytest.fixture(scope="module", params=[1, 2, 4], ids=["tp1", "tp2", "tp4"])
def tp(request):
    if request.param == 1:
        return _tp_checks(None)
    return _section(_launch(), f"tp{request.param}")


# ---------------------------------------------------------------------------
# TP = 1, 2, 4 exactness (one shared launch)
# ---------------------------------------------------------------------------

def test_targets_fall_in_every_shard(tp):
    """Guards the test data itself: if no target fell in a non-zero shard, the
    masked all-reduce of the target logit would go untested."""
    _ok(tp, "targets_cover_every_shard")


def test_logprobs_match_full_vocab(tp):
    """Guards against a wrong shard offset or a missing all-reduce of the target
    logit / partition function, which shows only at TP>1."""
    _ok(tp, "logprobs_value")


def test_logprobs_grad_matches_full_vocab(tp):
    """Guards against a backward that forgets the one-hot term on the owning
    shard or uses a shard-local softmax."""
    _ok(tp, "logprobs_grad")


def test_entropy_matches_full_vocab(tp):
    """Guards against summing p log p over the local shard only."""
    _ok(tp, "entropy_value")


def test_entropy_grad_matches_full_vocab(tp):
    """Guards against the naive p = exp(z - logZ) entropy whose autograd misses
    cross-shard terms: right values, gradients off by ~1 at TP=2."""
    _ok(tp, "entropy_grad")


def test_kl_matches_full_vocab(tp):
    """Guards against a KL using shard-local normalisers instead of the global logZs."""
    _ok(tp, "kl_value")


def test_kl_grad_matches_full_vocab_and_skips_ref(tp):
    """Guards against a wrong analytic dKL/dz and against gradients leaking
    into the frozen reference logits."""
    _ok(tp, "kl_grad", "kl_ref_has_no_grad")


def test_policy_loss_matches_full_vocab(tp):
    """Guards the whole path logits -> vocab-parallel logp -> GRPO loss (clip-higher,
    dual-clip, TIS, k3 KL, ragged mask with an empty row) against an fp64 reference."""
    _ok(tp, "policy_loss_value", "policy_loss_entropy_metric")


def test_policy_loss_grad_matches_full_vocab(tp):
    """Guards against loss gradients that are right at TP=1 but wrong per shard."""
    _ok(tp, "policy_loss_grad")


def test_chunk_size_gives_bitwise_identical_results(tp):
    """Guards against chunk boundaries dropping, double counting or misaligning
    rows (e.g. the last partial chunk) in forward or backward."""
    _ok(tp, *[f"chunked_{n}_{k}" for n in ("logprobs", "entropy", "kl") for k in ("value", "grad")])


def test_bf16_logits_fp32_values_and_close_grads(tp):
    """Guards against bf16 accumulation over the vocab (values off by ~1e-2) and
    against gradients returned in the wrong dtype."""
    _ok(tp, *[f"bf16_{n}_{k}" for n in ("logprobs", "entropy", "kl")
              for k in ("value", "grad", "dtypes")])


def test_target_range_is_checked_against_global_vocab(tp):
    """Guards against checking ids against V/tp (rejecting valid ids) or not at all
    (silently reading another token's logit)."""
    _ok(tp, "global_vocab_bound_rejected")


def test_dp2_microbatch_split_matches_whole_batch_every_agg_mode():
    """Guards against per-micro-batch or per-rank means: with global counts, DP=2
    x 2 micro-batches must equal one rank with the whole batch, for every mode."""
    res = _section(_launch(), "dp")
    _ok(res, *[f"dp_{k}_{m}" for m in MODES for k in ("loss", "grad")])


def test_tp2_dp2_loss_and_grads_match_fp64_whole_batch():
    """Guards the composition TP x DP x micro-batches (groups passed in, counts
    reduced over DP only) against the fp64 single-process loss."""
    res = _section(_launch(), "tp2dp2")
    _ok(res, *[f"{k}_{m}" for m in ("token-mean", "seq-mean-token-mean") for k in ("loss", "grad")])


def test_real_group_of_size_one_equals_none():
    """Guards against code paths that differ between tp_group=None and a real
    1-rank group (e.g. wrong rank offset or skipped reductions)."""
    res = _section(_launch(), "group1")
    _ok(res, *[f"{n}_{k}" for n in ("logprobs", "entropy", "kl") for k in ("value", "grad")])


# ---------------------------------------------------------------------------
# global normalisation, in-process
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_four_microbatches_equal_one_batch(mode):
    """Guards against averaging micro-batch means (wrong when token counts differ
    between micro-batches) instead of dividing each by the global count."""
    c = _batch_case()
    whole = c["logp"].clone().requires_grad_()
    loss1 = _split_loss(whole, c, mode, [slice(None)], None)
    loss1.backward()
    split = c["logp"].clone().requires_grad_()
    loss4 = _split_loss(split, c, mode, [slice(i, i + 2) for i in range(0, 8, 2)], None)
    loss4.backward()
    torch.testing.assert_close(loss4, loss1, **FP32)
    torch.testing.assert_close(split.grad, whole.grad, **FP32)
    ref = _ref_loss(c["logp"].double(), c["old_logp"].double(), c["advantages"].double(),
                    c["mask"], c["ref_logp"].double(), c["rollout_logp"].double(), mode=mode,
                    max_len=MAX_LEN, **LOSS_KW)
    torch.testing.assert_close(loss1.double(), ref, **FP32)


def test_global_batch_counts_counts_tokens_and_nonempty_seqs():
    """Guards against counting empty responses as sequences or padding as tokens."""
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    assert global_batch_counts(mask) == (3, 2)
    assert global_batch_counts([mask[:1].bool(), mask[1:].bool()]) == (3, 2)


def test_aggregate_modes_hand_worked():
    """Guards each mode's formula (DeepSeekMath seq-mean-token-mean, Dr. GRPO's
    constant max_len) and that an empty row adds to no denominator."""
    v = torch.tensor([[1.0, 2, 3], [4, 5, 6], [7, 8, 9]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]]).bool()
    expected = {"token-mean": 7 / 3, "seq-mean-token-mean": (1.5 + 4) / 2,
                "seq-mean-token-sum": 7 / 2, "seq-mean-token-sum-norm": 7 / (2 * 4)}
    for mode, want in expected.items():
        got = aggregate(v, m, mode, max_len=4)
        assert math.isclose(got.item(), want, rel_tol=1e-6), (mode, got.item(), want)
    assert aggregate(v, m, "token-mean", global_tokens=14).item() == pytest.approx(7 / 14)
    assert aggregate(v, m, "seq-mean-token-sum", global_seqs=7).item() == pytest.approx(1.0)


# ---------------------------------------------------------------------------
# advantages
# ---------------------------------------------------------------------------

def test_group_advantages_std_uses_sample_std():
    """Guards the documented convention (Bessel std, as TRL/verl): [1,0,1,0] ->
    +-0.5/sqrt(1/3) = +-0.866, not +-1 (population std)."""
    adv = group_advantages(torch.tensor([1.0, 0, 1, 0]), 4)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1, 1, -1]) * 0.5 / math.sqrt(1 / 3))


def test_group_advantages_dr_grpo_and_loo():
    """Guards Dr. GRPO (no std division) and RLOO (baseline excludes the sample itself)."""
    r = torch.tensor([1.0, 0, 1, 0, 3, 1, 2, 2])
    torch.testing.assert_close(group_advantages(r, 4, norm="none"),
                               torch.tensor([0.5, -0.5, 0.5, -0.5, 1, -1, 0, 0]))
    loo = group_advantages(r, 4, norm="none", baseline="loo")
    torch.testing.assert_close(loo, torch.tensor([2 / 3, -2 / 3, 2 / 3, -2 / 3,
                                                  3 - 5 / 3, 1 - 7 / 3, 0, 0]))


@pytest.mark.parametrize("norm,baseline", [("std", "mean"), ("std", "loo"), ("none", "loo")])
def test_all_equal_group_rewards_give_exact_zero(norm, baseline):
    """Guards against NaN from 0/0 and against rounding noise / eps blowing up:
    0.1 repeated does not average to exactly 0.1 in fp32."""
    r = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 0.5])
    adv = group_advantages(r, 3, norm=norm, baseline=baseline)
    assert torch.equal(adv[:3], torch.zeros(3))
    assert torch.isfinite(adv).all() and adv[3:].abs().sum() > 0


def test_group_size_one_gives_zero_not_nan():
    """Guards against torch.std of a single sample (NaN) reaching the loss."""
    assert torch.equal(group_advantages(torch.tensor([1.0, 2.0]), 1), torch.zeros(2))


def test_process_advantages_hand_worked_ragged_steps():
    """Guards the DeepSeekMath process-supervision rule: normalise over the
    group's steps (sample std), token advantage = sum of normalised rewards of
    steps ending at or after it; ragged step counts, an empty row, a flat group."""
    rewards = torch.tensor([[1.0, 0.0, 0.0], [1.0, 9.0, 9.0],     # group 0 (padding = 9)
                            [0.5, 0.5, 0.5], [9.0, 9.0, 9.0]])    # group 1: all equal
    ends = torch.tensor([[1, 4, -1], [2, -1, -1],
                         [0, 2, 5], [-1, -1, -1]])
    adv = process_advantages(rewards, ends, 2, 6)
    # group 0 steps: [1, 0, 1], mean 2/3, sample std sqrt(1/3)
    hi, lo = 1 / math.sqrt(3), -2 / math.sqrt(3)
    expected = torch.tensor([
        [hi + lo, hi + lo, lo, lo, lo, 0],
        [hi, hi, hi, 0, 0, 0],
        [0, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0],
    ])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------
# KL estimators
# ---------------------------------------------------------------------------

def test_kl_estimators_formulas_and_aliases():
    """Guards the sign convention x = logp - ref_logp in each estimator and the aliases."""
    logp = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-1.5, -1.0, -0.5])
    x = logp - ref
    want = {"k1": x, "k2": 0.5 * x ** 2, "k3": torch.exp(-x) + x - 1, "abs": x.abs()}
    for kind, w in want.items():
        torch.testing.assert_close(kl_penalty(logp, ref, kind), w)
    torch.testing.assert_close(kl_penalty(logp, ref, "mse"), want["k2"])
    torch.testing.assert_close(kl_penalty(logp, ref, "low_var_kl"), want["k3"])


def test_kl_clamp_keeps_k3_finite():
    """Guards against exp(ref_logp - logp) overflowing to inf when the policy has
    drifted far from the reference."""
    logp, ref = torch.tensor([-200.0]), torch.tensor([0.0])
    assert torch.isinf(kl_penalty(logp, ref, "k3")).all()
    got = kl_penalty(logp, ref, "k3", clamp=20.0)
    torch.testing.assert_close(got, torch.tensor([math.exp(20) - 20 - 1]))


# ---------------------------------------------------------------------------
# policy_loss edge cases, hand-worked
# ---------------------------------------------------------------------------

def _tokens(ratios, advs):
    old = torch.zeros(1, len(ratios))
    logp = torch.log(torch.tensor([ratios])).requires_grad_()
    return logp, old, torch.tensor([advs]), torch.ones(1, len(ratios), dtype=torch.bool)


def test_clip_low_differs_from_clip_high():
    """Guards asymmetric clipping (clip-higher): ratio 1.25 with A>0 must NOT be
    clipped at clip_high=0.28, ratio 0.75 with A<0 must be clipped at clip_low=0.2."""
    logp, old, adv, mask = _tokens([1.25, 1.30, 0.75, 0.85], [1.0, 1.0, -1.0, -1.0])
    loss, m = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    loss.backward()
    assert loss.item() == pytest.approx((-1.25 - 1.28 + 0.8 + 0.85) / 4, rel=1e-6)
    # d loss / d logp = -A * ratio / N where unclipped, 0 where clipped
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.25, 0, 0, 0.85]]) / 4)
    assert m["clipfrac_high"].item() == pytest.approx(0.25)
    assert m["clipfrac_low"].item() == pytest.approx(0.25)


def test_dual_clip_bounds_negative_advantages_only():
    """Guards dual-clip: caps the loss at -A*c for A<0 (and stops its gradient),
    leaves A>0 tokens alone."""
    logp, old, adv, mask = _tokens([5.0, 2.0, 5.0], [-1.0, -1.0, 1.0])
    loss, m = policy_loss(logp, old, adv, mask, dual_clip=3.0)
    loss.backward()
    assert loss.item() == pytest.approx((3.0 + 2.0 - 1.2) / 3, rel=1e-6)
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 2.0, 0.0]]) / 3)
    assert m["dual_clipfrac"].item() == pytest.approx(1 / 3)


def test_tis_cap_truncates_importance_weights():
    """Guards truncated IS: weight = min(exp(old - rollout), cap), detached, and the
    rollout-vs-trainer gap metric."""
    logp, old, adv, mask = _tokens([1.0, 1.0], [1.0, 1.0])
    rollout = torch.tensor([[-math.log(4.0), math.log(2.0)]])   # weights 4 -> cap 2, and 0.5
    old = old.clone().requires_grad_()
    loss, m = policy_loss(logp, old, adv, mask, rollout_logp=rollout, tis_cap=2.0)
    loss.backward()
    assert loss.item() == pytest.approx((-2.0 - 0.5) / 2, rel=1e-6)
    torch.testing.assert_close(logp.grad, torch.tensor([[-2.0, -0.5]]) / 2)
    assert old.grad is None or torch.equal(old.grad, torch.zeros_like(old))
    assert m["rollout_logp_gap"].item() == pytest.approx(1.5 * math.log(2.0), rel=1e-6)
    assert m["tis_clipfrac"].item() == pytest.approx(0.5)


@pytest.mark.parametrize("mode", MODES)
def test_zero_length_response_contributes_nothing(mode):
    """Guards against NaN from 0/0 in per-sequence means and from inf/NaN
    log-probs at padded positions (0 * inf gradients), and against an empty
    response shifting any denominator."""
    c = _batch_case()
    rows = c["logp"].shape[0]
    keep = [i for i in range(rows) if c["mask"][i].any()]
    assert len(keep) == rows - 1
    bad = c["logp"].clone()
    bad[~c["mask"]] = float("inf")
    bad[2] = float("nan")
    leaf = bad.requires_grad_()
    kw = dict(ref_logp=c["ref_logp"], rollout_logp=c["rollout_logp"], agg=mode, max_len=MAX_LEN,
              **LOSS_KW)
    loss, metrics = policy_loss(leaf, c["old_logp"], c["advantages"], c["mask"], **kw)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(leaf.grad).all()
    assert all(torch.isfinite(v).all() for v in metrics.values())
    assert torch.equal(leaf.grad[~c["mask"]], torch.zeros(int((~c["mask"]).sum())))
    sub = {k: v[keep] for k, v in c.items()}
    kw.update(ref_logp=sub["ref_logp"], rollout_logp=sub["rollout_logp"])
    loss_without, _ = policy_loss(sub["logp"], sub["old_logp"], sub["advantages"], sub["mask"], **kw)
    torch.testing.assert_close(loss, loss_without, **FP32)


def test_all_masked_batch_gives_zero_loss():
    """Guards against 0/0 when a micro-batch (or the global batch) has no tokens."""
    logp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    for mode in MODES:
        loss, _ = policy_loss(logp, logp.detach(), torch.ones(2), mask, agg=mode, max_len=3,
                              global_tokens=0, global_seqs=0)
        assert loss.item() == 0.0
        loss2, _ = policy_loss(logp, logp.detach(), torch.ones(2), mask, agg=mode, max_len=3)
        assert loss2.item() == 0.0


# ---------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------

_z, _t = torch.randn(4, 8), torch.randint(0, 8, (4,))
_lp, _m = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
BAD_INPUTS = {
    "logits_targets_shape": (lambda: vocab_parallel_logprobs(_z, torch.zeros(5, dtype=torch.long)),
                             "targets"),
    "target_id_too_big": (lambda: vocab_parallel_logprobs(_z, torch.full((4,), 8)), "targets"),
    "target_id_negative": (lambda: vocab_parallel_logprobs(_z, torch.full((4,), -1)), "targets"),
    "float_targets": (lambda: vocab_parallel_logprobs(_z, _t.float()), "targets"),
    "chunk_size_zero": (lambda: vocab_parallel_entropy(_z, chunk_size=0), "chunk_size"),
    "ref_logits_shape": (lambda: vocab_parallel_kl(_z, torch.randn(4, 6)), "ref_logits_shard"),
    "group_size_not_dividing": (lambda: group_advantages(torch.zeros(10), 4), "group_size"),
    "unknown_norm": (lambda: group_advantages(torch.zeros(4), 2, norm="zscore"), "norm"),
    "unknown_baseline": (lambda: group_advantages(torch.zeros(4), 2, baseline="median"), "baseline"),
    "rewards_2d": (lambda: group_advantages(torch.zeros(2, 2), 2), "rewards"),
    "unknown_kl_kind": (lambda: kl_penalty(_lp, _lp, "k4"), "kind"),
    "kl_broadcast": (lambda: kl_penalty(torch.zeros(3), torch.zeros(1), "k1"), "ref_logp"),
    "unknown_agg_mode": (lambda: aggregate(_lp, _m, "sum"), "mode"),
    "agg_mask_shape": (lambda: aggregate(_lp, torch.ones(3, dtype=torch.bool), "token-mean"), "mask"),
    "norm_mode_needs_max_len": (lambda: aggregate(_lp, _m, "seq-mean-token-sum-norm"), "max_len"),
    "old_logp_shape": (lambda: policy_loss(_lp, torch.zeros(2, 4), torch.zeros(2), _m), "old_logp"),
    "advantages_shape": (lambda: policy_loss(_lp, _lp, torch.zeros(3), _m), "advantages"),
    "mask_broadcast": (lambda: policy_loss(_lp, _lp, torch.zeros(2), _m[:1]), "mask"),
    "policy_unknown_agg": (lambda: policy_loss(_lp, _lp, torch.zeros(2), _m, agg="x"), "agg"),
    "policy_unknown_kl_kind": (lambda: policy_loss(_lp, _lp, torch.zeros(2), _m, kl_kind="x"),
                               "kl_kind"),
    "kl_coef_without_ref": (lambda: policy_loss(_lp, _lp, torch.zeros(2), _m, kl_coef=0.1),
                            "ref_logp"),
    "process_group_size": (lambda: process_advantages(torch.zeros(4, 2), torch.zeros(4, 2,
                           dtype=torch.long), 3, 5), "group_size"),
    "process_end_out_of_range": (lambda: process_advantages(torch.zeros(2, 1), torch.full(
                                 (2, 1), 5), 2, 5), "step_end_index"),
    "process_end_not_increasing": (lambda: process_advantages(torch.zeros(2, 2), torch.tensor(
                                   [[3, 1], [0, -1]]), 2, 5), "step_end_index"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_raises_value_error_naming_argument(case):
    """Guards against silent broadcasting, out-of-vocab ids reading the wrong
    logit, and typos in mode names silently falling back to a default."""
    fn, arg = BAD_INPUTS[case]
    with pytest.raises(ValueError, match=arg):
        fn()
