"""Tests for grpo_mega.algorithms.vocab_parallel: exactness at TP=1/2/4, and the
GRPO loss and global normalisation through it on real ranks.

Multi-rank checks run on real gloo ranks (tests/distributed.py). Each launch
costs seconds, so ONE launch of 4 ranks runs every multi-rank check (TP=4 on
the world; TP=2, DP=2, TP2xDP2 and 1-rank groups on subgroups) and returns
{check name: None if it passed, else the failure message}; the small tests
below each assert one entry. TP=1 runs in-process with tp_group=None. The
DP / TP x DP loss checks share that launch, so they live here rather than in
test_loss.py. Data and fp64 references: reference.py.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from grpo_mega.algorithms import (
    exact_kl,
    policy_loss,
    vocab_parallel_entropy,
    vocab_parallel_kl,
    vocab_parallel_logprobs,
)
from tests.distributed import run_ranks
from tests.unit.algorithms.reference import (
    FP32, LOSS_KW, MODES, B, L, V, batch_case, case, ref_loss, split_loss,
)


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
    loss = ref_loss(vals["logprobs"], c["old_logp"].double(), c["advantages"].double(),
                     c["mask"], ref_logp, c["rollout_logp"].double(), **LOSS_KW)
    out["policy_loss"] = (loss.detach(), torch.autograd.grad(loss, z, retain_graph=True)[0])
    # kl_kind="full": the exact KL(pi || pi_ref) written from scratch, p (log p - log q)
    loss_full = ref_loss(vals["logprobs"], c["old_logp"].double(), c["advantages"].double(),
                          c["mask"], None, c["rollout_logp"].double(),
                          **{**LOSS_KW, "kl_kind": "full"}, kl_full=vals["kl"])
    out["policy_loss_full"] = (loss_full.detach(), torch.autograd.grad(loss_full, z)[0])
    out["kl_mean"] = vals["kl"].detach()[c["mask"]].mean()
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
    c = case()
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

    # kl_kind="full": policy_loss over the exact vocab-parallel KL, gradient w.r.t. the
    # policy logits through both the surrogate and the KL; none into the reference
    leaf = _shard(c["logits"], group).clone().requires_grad_()
    ref_leaf = _shard(c["ref_logits"], group).clone().requires_grad_()
    logp = vocab_parallel_logprobs(leaf, c["targets"], group)
    kl = exact_kl("full", leaf, ref_leaf, group)
    loss, metrics = policy_loss(logp, c["old_logp"], c["advantages"], c["mask"], kl=kl,
                                rollout_logp=c["rollout_logp"], **{**LOSS_KW, "kl_kind": "full"})
    loss.backward()
    _close(res, "policy_loss_full_value", loss, ref["policy_loss_full"][0], **FP32)
    _close(res, "policy_loss_full_grad", leaf.grad, _shard(ref["policy_loss_full"][1], group), **FP32)
    _close(res, "policy_loss_full_kl_metric", metrics["kl"], ref["kl_mean"], **FP32)
    res["policy_loss_full_ref_has_no_grad"] = (None if ref_leaf.grad is None
                                               else "the reference logits got a gradient")

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


def _dp_checks(dp_group) -> dict:
    """DP=2, 2 micro-batches per rank, vs one rank with the whole batch."""
    c = batch_case()
    res = {}
    per = c["logp"].shape[0] // dist.get_world_size(dp_group)
    lo = dist.get_rank(dp_group) * per
    for mode in MODES:
        whole = c["logp"].clone().requires_grad_()
        loss_whole = split_loss(whole, c, mode, [slice(None)], None)
        loss_whole.backward()

        leaf = c["logp"].clone().requires_grad_()
        mbs = [slice(lo, lo + per // 2), slice(lo + per // 2, lo + per)]
        loss = split_loss(leaf, c, mode, mbs, dp_group)
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
    c = case()
    res = {}
    z = c["logits"].double().requires_grad_()
    logp64 = torch.log_softmax(z, -1).gather(-1, c["targets"][..., None]).squeeze(-1)
    ref_logp64 = torch.log_softmax(c["ref_logits"].double(), -1).gather(
        -1, c["targets"][..., None]).squeeze(-1)
    c["ref_logp"] = ref_logp64.float()
    for mode in ("token-mean", "seq-mean-token-mean"):
        loss64 = ref_loss(logp64, c["old_logp"].double(), c["advantages"].double(), c["mask"],
                           ref_logp64, c["rollout_logp"].double(), mode=mode, **LOSS_KW)
        grad64, = torch.autograd.grad(loss64, z, retain_graph=True)
        leaf = _shard(c["logits"], tp_group).clone().requires_grad_()
        rows = [slice(2 * dp_rank, 2 * dp_rank + 1), slice(2 * dp_rank + 1, 2 * dp_rank + 2)]
        logp = vocab_parallel_logprobs(leaf, c["targets"], tp_group)
        loss = split_loss(logp, c, mode, rows, dp_group)
        loss.backward()
        total, grad = loss.detach().clone(), leaf.grad.clone()
        dist.all_reduce(total, group=dp_group)
        dist.all_reduce(grad, group=dp_group)
        _close(res, f"loss_{mode}", total, loss64, **FP32)
        _close(res, f"grad_{mode}", grad, _shard(grad64, tp_group), **FP32)
    return res


def _real_group_of_one_checks(group) -> dict:
    """A real process group of size 1 must behave exactly like tp_group=None."""
    c = case()
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


def test_full_kl_policy_loss_and_grad_match_fp64_full_vocab(tp):
    """Guards kl_kind="full" in the loss: the exact KL taken in the wrong direction
    (KL(ref || pi)), summed over the local vocab shard only (no all-reduce), detached from
    the policy (no KL gradient), or aggregated differently from the surrogate would move
    the loss or its gradient w.r.t. the policy logits away from the fp64 reference."""
    _ok(tp, "policy_loss_full_value", "policy_loss_full_grad", "policy_loss_full_kl_metric")


def test_full_kl_policy_loss_sends_no_gradient_into_the_reference(tp):
    """Guards against the frozen reference receiving a gradient through the exact KL."""
    _ok(tp, "policy_loss_full_ref_has_no_grad")


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
# bad input
# ---------------------------------------------------------------------------

_z, _t = torch.randn(4, 8), torch.randint(0, 8, (4,))
BAD_INPUTS = {
    "logits_targets_shape": (lambda: vocab_parallel_logprobs(_z, torch.zeros(5, dtype=torch.long)),
                             "targets"),
    "target_id_too_big": (lambda: vocab_parallel_logprobs(_z, torch.full((4,), 8)), "targets"),
    "target_id_negative": (lambda: vocab_parallel_logprobs(_z, torch.full((4,), -1)), "targets"),
    "float_targets": (lambda: vocab_parallel_logprobs(_z, _t.float()), "targets"),
    "chunk_size_zero": (lambda: vocab_parallel_entropy(_z, chunk_size=0), "chunk_size"),
    "ref_logits_shape": (lambda: vocab_parallel_kl(_z, torch.randn(4, 6)), "ref_logits_shard"),
}


@pytest.mark.parametrize("bad", sorted(BAD_INPUTS))
def test_bad_input_raises_value_error_naming_argument(bad):
    """Guards against silent broadcasting, out-of-vocab ids reading the wrong
    logit, float ids and a zero chunk size looping forever."""
    fn, arg = BAD_INPUTS[bad]
    with pytest.raises(ValueError, match=arg):
        fn()
