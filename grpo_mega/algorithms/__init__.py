"""GRPO math: vocab-parallel log-probs, entropy and KL; advantages; the loss.

What
    Pure functions for one GRPO update, written for Megatron tensor parallelism
    (TP), where each rank holds a slice of the vocabulary, ``logits: [..., V/tp]``:

    * ``vocab_parallel_logprobs`` / ``vocab_parallel_entropy`` /
      ``vocab_parallel_kl``: exact per-token log pi(y), H(pi) and
      KL(pi_theta || pi_ref) from vocab shards, with analytic backwards;
    * ``group_advantages`` (GRPO z-score, Dr. GRPO, RLOO) and
      ``process_advantages`` (DeepSeekMath process supervision);
    * ``kl_penalty`` (k1/k2/k3/abs sample estimators), ``aggregate`` (loss
      reduction modes), ``policy_loss`` (clipped surrogate + KL + TIS);
    * ``global_batch_counts``: the token/sequence counts that make micro-batch
      and data-parallel splits give the same loss and gradients.

Why
    megatron-core 0.16 has vocab-parallel cross-entropy but no log-prob or
    entropy helper, and gathering the full vocabulary costs tp x memory. Each
    vocab-parallel function here does two small all-reduces over [tokens]
    (a MAX, then one stacked SUM) in the forward and NONE in the backward: the
    gradient of each quantity w.r.t. the local shard only needs per-token
    statistics already reduced in the forward. Differentiating through
    ``exp(z - logZ)`` on a shard instead would miss the cross-shard terms of
    d logZ / dz and give wrong gradients at TP > 1 while passing at TP = 1.

    Memory: the forward saves the input logits (a reference, no copy; logp,
    entropy and KL of the same logits share it) and O(tokens) statistics. The
    backward computes in place in the gradient it returns, the one shard-sized
    buffer; the only other temporaries are one [chunk, V/tp] buffer for the KL
    backward and, for bf16/fp16 logits, one fp32 [chunk, V/tp] buffer. The
    forward's temporaries are [chunk, V/tp] too. ``chunk_size`` (tokens per
    chunk; None = all tokens at once) therefore bounds peak extra memory at
    one shard plus O(chunk_size x V/tp), not tokens x vocab; chunking changes
    no result bit (tested). bf16/fp16 logits are upcast one chunk at a time;
    results are fp32 and gradients come back in the logits' dtype.

Conventions
    * Process groups are arguments (``tp_group=None`` means a single rank); the
      vocabulary is split in rank order in equal contiguous shards, as
      megatron's ``VocabParallelEmbedding`` / output layer does. All TP ranks
      must pass the same token layout and targets. Padded vocabulary entries
      (megatron pads V to a multiple of 128 x tp) are part of the softmax; mask
      them in the logits (a large negative finite value) if that matters.
    * Variants (KL estimators, aggregation modes, advantage baselines and
      normalisations) live in small registries keyed by name.
    * Bad input raises ValueError naming the offending argument, before any
      collective can hang. Shapes must match exactly; nothing is broadcast
      except where a docstring says so.

Global normalisation contract (micro-batches and data parallelism)
    A training step sees a global batch split over DP ranks and, on each rank,
    into micro-batches (split by whole sequences, never inside one). Each
    micro-batch's loss is ``sum(contributions) / global_count``, where the
    count is over the WHOLE global batch (``global_batch_counts``). Summing the
    micro-batch losses of all ranks then gives exactly the global mean, so the
    gradients must be SUMMED over micro-batches and DP ranks. With megatron's
    pipeline schedule (``get_forward_backward_func``) that means either:

    1. legacy ``loss_func -> (loss, metrics)``: the schedule divides the loss by
       ``num_microbatches`` (and multiplies by the CP size), and megatron's DDP
       averages gradients over DP. Return
       ``loss * num_microbatches * dp_size`` (``/ cp_size`` with CP) to undo
       both; or
    2. ``config.calculate_per_token_loss=True`` and
       ``loss_func -> (loss, count, metrics)``: the schedule leaves the loss
       alone, DDP sums, and ``finalize_model_grads`` divides all gradients by
       the count summed over micro-batches and DP. Call ``policy_loss`` with
       ``global_tokens=1`` (``token-mean``) or ``global_seqs=1`` (``seq-*``
       modes), so the loss is a plain sum, and return as ``count`` the local
       token (or non-empty sequence) count as a ``torch.int`` tensor. No
       pre-pass for counts is needed then.

    Also clone any loss value you log: the schedule divides it in place.

Run the tests with
    OMP_NUM_THREADS=1 python -m pytest -q tests/unit/algorithms/test_vocab_parallel.py
"""
from __future__ import annotations

from typing import Callable, Iterable, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

Tensor = torch.Tensor
Count = Union[int, float, Tensor]

__all__ = [
    "vocab_parallel_logprobs",
    "vocab_parallel_entropy",
    "vocab_parallel_kl",
    "group_advantages",
    "process_advantages",
    "kl_penalty",
    "aggregate",
    "global_batch_counts",
    "policy_loss",
    "KL_ESTIMATORS",
    "KL_ALIASES",
    "AGGREGATIONS",
    "BASELINES",
    "NORMS",
]


# ---------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------

def _lookup(registry: Mapping[str, object], name: str, arg: str):
    if not isinstance(name, str) or name not in registry:
        raise ValueError(f"{arg}={name!r} is unknown; choose one of {sorted(registry)}")
    return registry[name]


def _same_shape(a: Tensor, a_name: str, b: Tensor, b_name: str) -> None:
    if not isinstance(b, Tensor):
        raise ValueError(f"{b_name} must be a tensor, got {type(b).__name__}")
    if a.shape != b.shape:
        raise ValueError(
            f"{b_name} has shape {tuple(b.shape)} but {a_name} has {tuple(a.shape)}; "
            "shapes must match exactly (no broadcasting)")


def _tp_size_rank(group) -> Tuple[int, int]:
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _all_reduce(t: Tensor, op, group) -> Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _chunks(n: int, chunk_size: Optional[int]):
    """Yield (start, end) token ranges; chunk_size=None means one chunk."""
    step = n if chunk_size is None else chunk_size
    for s in range(0, n, max(step, 1)):
        yield s, min(s + step, n)


def _check_chunk_size(chunk_size) -> None:
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")


def _check_logits(logits: Tensor, name: str) -> None:
    if not isinstance(logits, Tensor) or not logits.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor")
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"{name} must have a non-empty last (vocab) dim, got {tuple(logits.shape)}")


def _compute_dtype(*tensors: Tensor) -> torch.dtype:
    # fp32 at least: bf16 sums over 10^4..10^5 vocab entries lose several digits.
    dt = torch.float32
    for t in tensors:
        dt = torch.promote_types(dt, t.dtype)
    return dt


def _sub_into(a: Tensor, b: Tensor, out: Tensor) -> Tensor:
    """out = a - b computed in out's dtype (bf16 - bf16 would round in bf16)."""
    if a.dtype != out.dtype and b.dtype != out.dtype:
        out.copy_(b)
        b = out
    return torch.sub(a, b, out=out)


def _flat(logits: Tensor) -> Tensor:
    # contiguous() once here, so every later reshape is a view, never a copy.
    return logits.contiguous().view(-1, logits.shape[-1])


# ---------------------------------------------------------------------------
# vocab-parallel log-probs, entropy, KL
# ---------------------------------------------------------------------------

# Precision: the per-row statistics are kept as (max m, sum S) and combined in
# fp64 (O(tokens) work). Folding them into one fp32 logZ = m + log S would round at ulp(|logZ|)
# (~1e-6 for logits of a few units) and that error lands on every output and
# gradient; (z - m) is exact for the tokens that dominate the softmax.

def _row(t: Tensor) -> Tensor:
    return t.double()


class _VocabParallelLogprobs(torch.autograd.Function):
    """log_softmax(z)[y] over the full vocab from shards.  z: [N, V/tp], y: [N]."""

    @staticmethod
    def forward(ctx, z: Tensor, targets: Tensor, group, chunk_size):
        cdt = _compute_dtype(z)
        n, vs = z.shape
        _, rank = _tp_size_rank(group)
        local = targets - rank * vs
        in_shard = (local >= 0) & (local < vs)
        idx = torch.where(in_shard, local, torch.zeros_like(local))

        # Any per-row constant works for stability; the global max makes exp <= 1.
        m = _all_reduce(z.amax(dim=-1).to(cdt), dist.ReduceOp.MAX, group)
        stats = torch.empty(2, n, dtype=cdt, device=z.device)  # [S = sum exp(z - m), z_target]
        for s, e in _chunks(n, chunk_size):
            stats[0, s:e] = torch.sub(z[s:e], m[s:e, None]).exp_().sum(dim=-1)
        picked = z.gather(1, idx[:, None]).squeeze(1).to(cdt)
        stats[1] = torch.where(in_shard, picked, torch.zeros_like(picked))
        _all_reduce(stats, dist.ReduceOp.SUM, group)

        ctx.save_for_backward(z, idx, in_shard, m, stats[0])
        ctx.chunk_size = chunk_size
        return ((_row(stats[1]) - _row(m)) - _row(stats[0]).log()).to(cdt)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        z, idx, in_shard, m, sum_exp = ctx.saved_tensors
        cdt = m.dtype
        g = grad_out.to(cdt)
        # d logp / dz = onehot(y) - exp(z - m) / S: the softmax part needs only (m, S).
        coef = (-_row(g) / _row(sum_exp)).to(cdt)[:, None]
        grad = torch.empty_like(z)
        for s, e in _chunks(z.shape[0], ctx.chunk_size):
            out = grad[s:e]
            buf = out if out.dtype == cdt else torch.empty(out.shape, dtype=cdt, device=z.device)
            torch.sub(z[s:e], m[s:e, None], out=buf).exp_().mul_(coef[s:e])
            buf.scatter_add_(1, idx[s:e, None], (g[s:e] * in_shard[s:e])[:, None])
            if buf is not out:
                out.copy_(buf)
        return grad, None, None, None


class _VocabParallelEntropy(torch.autograd.Function):
    """H = -sum p log p over the full vocab from shards.  z: [N, V/tp] -> [N]."""

    @staticmethod
    def forward(ctx, z: Tensor, group, chunk_size):
        cdt = _compute_dtype(z)
        n = z.shape[0]
        m = _all_reduce(z.amax(dim=-1).to(cdt), dist.ReduceOp.MAX, group)
        stats = torch.empty(2, n, dtype=cdt, device=z.device)  # [S = sum e, A = sum e (z - m)]
        for s, e in _chunks(n, chunk_size):
            shifted = torch.sub(z[s:e], m[s:e, None])
            ex = shifted.exp()
            stats[0, s:e] = ex.sum(dim=-1)
            stats[1, s:e] = shifted.mul_(ex).sum(dim=-1)
        _all_reduce(stats, dist.ReduceOp.SUM, group)

        # With p = e / S and e = exp(z - m):  H = log S - A / S.
        log_s = _row(stats[0]).log()
        ent = log_s - _row(stats[1]) / _row(stats[0])
        ctx.save_for_backward(z, m, (log_s - ent).to(cdt), ent.to(cdt))
        ctx.chunk_size = chunk_size
        return ent.to(cdt)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        z, m, log_s_minus_h, ent = ctx.saved_tensors
        cdt = m.dtype
        # dH/dz = -p (log p + H).  With q = p e^H = exp((z - m) - (log S - H)):
        # p (log p + H) = e^-H q log q, so one buffer holds q and then q log q
        # (xlogy keeps p = 0 at 0, not NaN).
        coef = (-_row(grad_out) * torch.exp(-_row(ent))).to(cdt)[:, None]
        shift = log_s_minus_h[:, None]
        grad = torch.empty_like(z)
        for s, e in _chunks(z.shape[0], ctx.chunk_size):
            out = grad[s:e]
            buf = out if out.dtype == cdt else torch.empty(out.shape, dtype=cdt, device=z.device)
            torch.sub(z[s:e], m[s:e, None], out=buf).sub_(shift[s:e]).exp_()
            buf.xlogy_(buf).mul_(coef[s:e])
            if buf is not out:
                out.copy_(buf)
        return grad, None, None


class _VocabParallelKL(torch.autograd.Function):
    """KL(softmax(z) || softmax(y)) over the full vocab.  z, y: [N, V/tp] -> [N]."""

    @staticmethod
    def forward(ctx, z: Tensor, y: Tensor, group, chunk_size):
        cdt = _compute_dtype(z, y)
        n = z.shape[0]
        maxes = torch.stack([z.amax(dim=-1).to(cdt), y.amax(dim=-1).to(cdt)])
        _all_reduce(maxes, dist.ReduceOp.MAX, group)
        mz, my = maxes[0], maxes[1]
        stats = torch.empty(3, n, dtype=cdt, device=z.device)  # [Sz, Sy, sum ez (z - y)]
        for s, e in _chunks(n, chunk_size):
            ez = torch.sub(z[s:e], mz[s:e, None]).exp_()
            stats[0, s:e] = ez.sum(dim=-1)
            tmp = torch.sub(y[s:e], my[s:e, None]).exp_()
            stats[1, s:e] = tmp.sum(dim=-1)
            _sub_into(z[s:e], y[s:e], tmp)
            stats[2, s:e] = tmp.mul_(ez).sum(dim=-1)
        _all_reduce(stats, dist.ReduceOp.SUM, group)

        # log p - log q = (z - y) - c  with  c = (mz - my) + log Sz - log Sy,
        # so KL = E_p[z - y] - c.
        sz, sy = _row(stats[0]), _row(stats[1])
        c = (_row(mz) - _row(my)) + (sz.log() - sy.log())
        kl = _row(stats[2]) / sz - c
        ctx.save_for_backward(z, y, mz, stats[0], (c + kl).to(cdt))
        ctx.chunk_size = chunk_size
        return kl.to(cdt)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        z, y, mz, sum_ez, offset = ctx.saved_tensors
        cdt = mz.dtype
        # dKL/dz = p (log p - log q - KL) = (ez / Sz) ((z - y) - (c + KL));
        # the E_p[d log p / dz] term vanishes.
        coef = (_row(grad_out) / _row(sum_ez)).to(cdt)[:, None]
        grad = torch.empty_like(z)
        for s, e in _chunks(z.shape[0], ctx.chunk_size):
            out = grad[s:e]
            buf = out if out.dtype == cdt else torch.empty(out.shape, dtype=cdt, device=z.device)
            _sub_into(z[s:e], y[s:e], buf).sub_(offset[s:e, None])
            p = torch.sub(z[s:e], mz[s:e, None]).exp_().mul_(coef[s:e])
            buf.mul_(p)
            if buf is not out:
                out.copy_(buf)
        return grad, None, None, None


def vocab_parallel_logprobs(logits_shard: Tensor, targets: Tensor, tp_group=None, *,
                            chunk_size: Optional[int] = None) -> Tensor:
    """Exact log_softmax(logits)[target] over the full vocabulary, from a vocab shard.

    Args:
        logits_shard: [..., V/tp] this rank's vocab slice (rank r holds ids
            [r*V/tp, (r+1)*V/tp)). Any float dtype; bf16/fp16 are upcast to fp32.
        targets: [...] GLOBAL token ids in [0, V), same leading shape as the logits.
            Padding positions need a valid id (e.g. 0, not -100); mask their
            log-probs afterwards (``policy_loss`` / ``aggregate`` take the mask).
        tp_group: tensor-parallel process group, or None for a single rank.
        chunk_size: tokens per chunk to bound the [chunk, V/tp] temporaries.

    Returns:
        [...] log-probs, fp32 (fp64 for fp64 logits). Differentiable w.r.t.
        ``logits_shard``; the backward needs no communication.
    """
    _check_logits(logits_shard, "logits_shard")
    _check_chunk_size(chunk_size)
    if not isinstance(targets, Tensor):
        raise ValueError("targets must be a tensor of token ids")
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise ValueError(f"targets must hold integer token ids, got dtype {targets.dtype}")
    if targets.shape != logits_shard.shape[:-1]:
        raise ValueError(f"targets has shape {tuple(targets.shape)} but logits_shard has "
                         f"{tuple(logits_shard.shape)}; targets must be logits_shard.shape[:-1]")
    tp, _ = _tp_size_rank(tp_group)
    vocab = logits_shard.shape[-1] * tp
    # One host sync; an out-of-range id would otherwise silently give logp of another token.
    if targets.numel() and bool(((targets < 0) | (targets >= vocab)).any()):
        raise ValueError(f"targets contain ids outside the vocabulary [0, {vocab}) "
                         f"(V/tp={logits_shard.shape[-1]}, tp={tp})")
    out = _VocabParallelLogprobs.apply(_flat(logits_shard), targets.reshape(-1).long(),
                                       tp_group, chunk_size)
    return out.view(targets.shape)


def vocab_parallel_entropy(logits_shard: Tensor, tp_group=None, *,
                           chunk_size: Optional[int] = None) -> Tensor:
    """Exact per-token entropy of softmax(logits) over the full vocabulary.

    Args:
        logits_shard: [..., V/tp] this rank's vocab slice.
        tp_group: tensor-parallel process group, or None for a single rank.
        chunk_size: tokens per chunk to bound the [chunk, V/tp] temporaries.

    Returns:
        [...] entropy in nats, fp32 (fp64 for fp64 logits), with the analytic
        gradient dH/dz = -p (log p + H) (no communication in the backward).
    """
    _check_logits(logits_shard, "logits_shard")
    _check_chunk_size(chunk_size)
    out = _VocabParallelEntropy.apply(_flat(logits_shard), tp_group, chunk_size)
    return out.view(logits_shard.shape[:-1])


def vocab_parallel_kl(logits_shard: Tensor, ref_logits_shard: Tensor, tp_group=None, *,
                      chunk_size: Optional[int] = None) -> Tensor:
    """Exact per-token KL(pi_theta || pi_ref) = sum_v p (log p - log q) (verl's ``full``).

    Args:
        logits_shard: [..., V/tp] policy logits, this rank's vocab slice.
        ref_logits_shard: [..., V/tp] reference logits, same shape. Treated as
            constant: no gradient flows to it.
        tp_group: tensor-parallel process group, or None for a single rank.
        chunk_size: tokens per chunk to bound the [chunk, V/tp] temporaries.

    Returns:
        [...] KL in nats, fp32 (fp64 for fp64 inputs), differentiable w.r.t.
        the policy logits: dKL/dz = p (log p - log q - KL).
    """
    _check_logits(logits_shard, "logits_shard")
    _check_logits(ref_logits_shard, "ref_logits_shard")
    _same_shape(logits_shard, "logits_shard", ref_logits_shard, "ref_logits_shard")
    _check_chunk_size(chunk_size)
    out = _VocabParallelKL.apply(_flat(logits_shard), _flat(ref_logits_shard.detach()),
                                 tp_group, chunk_size)
    return out.view(logits_shard.shape[:-1])


# ---------------------------------------------------------------------------
# advantages
# ---------------------------------------------------------------------------

def _baseline_mean(grouped: Tensor) -> Tensor:
    return grouped.mean(dim=1, keepdim=True)


def _baseline_loo(grouped: Tensor) -> Tensor:
    # RLOO: each sample's baseline is the mean of the OTHER G-1 samples, so the
    # baseline is independent of the sample and the estimator stays unbiased.
    g = grouped.shape[1]
    return (grouped.sum(dim=1, keepdim=True) - grouped) / (g - 1)


def _group_std(grouped: Tensor) -> Tensor:
    """Sample (Bessel, ddof=1) std per group: [P, G] -> [P, 1]."""
    g = grouped.shape[1]
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    return (centred.square().sum(dim=1, keepdim=True) / max(g - 1, 1)).sqrt()


def _norm_std(centred: Tensor, grouped: Tensor, eps: float) -> Tensor:
    return centred / (_group_std(grouped) + eps)


def _norm_none(centred: Tensor, grouped: Tensor, eps: float) -> Tensor:
    # Dr. GRPO: dividing by the group std up-weights easy/hard (low-variance)
    # prompts; leaving it out removes that question-level difficulty bias.
    return centred


BASELINES: dict[str, Callable[[Tensor], Tensor]] = {"mean": _baseline_mean, "loo": _baseline_loo}
NORMS: dict[str, Callable[[Tensor, Tensor, float], Tensor]] = {"std": _norm_std, "none": _norm_none}


def _check_group_size(group_size, n: int, what: str) -> int:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if n % group_size:
        raise ValueError(f"group_size={group_size} does not divide the {n} rows of {what}")
    return group_size


def _float(t: Tensor) -> Tensor:
    return t if t.is_floating_point() else t.float()


def group_advantages(rewards: Tensor, group_size: int, *, norm: str = "std",
                     baseline: str = "mean", eps: float = 1e-6) -> Tensor:
    """Outcome advantages per sample from rewards of G samples per prompt.

    Args:
        rewards: [P*G] scalar reward per sample; each prompt's G samples are
            contiguous (rows g*G .. g*G+G-1 form group g).
        group_size: G, must divide len(rewards).
        norm: "std" (DeepSeekMath GRPO z-score: divide by the group std + eps)
            or "none" (Dr. GRPO: no std division).
        baseline: "mean" (group mean) or "loo" (leave-one-out mean of the
            other G-1 samples, RLOO; needs G >= 2).
        eps: added to the std to keep tiny-variance groups bounded.

    The std is the SAMPLE std (Bessel's ddof=1), like ``torch.std`` as used
    by the reference GRPO implementations (TRL, verl): the paper only writes
    std(r), and matching them keeps published learning rates, clip ranges and
    KL coefficients transferable. Its scale differs from the population std by
    sqrt(G/(G-1)) (e.g. G=2, binary rewards give +-0.707, not +-1).

    Groups whose rewards are all equal (including G=1) carry no learning
    signal and get exactly 0, never NaN or rounding noise divided by eps.

    Returns:
        [P*G] advantages, float (fp32 for integer/bool rewards).
    """
    if not isinstance(rewards, Tensor) or rewards.dim() != 1:
        raise ValueError("rewards must be a 1-D tensor [num_prompts*group_size]")
    _check_group_size(group_size, rewards.numel(), "rewards")
    base_fn = _lookup(BASELINES, baseline, "baseline")
    norm_fn = _lookup(NORMS, norm, "norm")
    if baseline == "loo" and group_size < 2:
        raise ValueError("group_size must be >= 2 for baseline='loo'")
    r = _float(rewards)
    if not bool(torch.isfinite(r).all()):
        raise ValueError("rewards contain NaN or inf")
    grouped = r.view(-1, group_size)
    adv = norm_fn(grouped - base_fn(grouped), grouped, eps)
    equal = grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)
    return torch.where(equal, torch.zeros_like(adv), adv).reshape(-1)


def process_advantages(step_rewards: Tensor, step_end_index: Tensor, group_size: int,
                       response_len: int, *, eps: float = 1e-6) -> Tensor:
    """Process-supervision GRPO advantages (DeepSeekMath, Sec. 4.1.3).

    Layout (padded, ragged along steps):
        step_rewards:   [B, S] float, reward of step j of response b.
        step_end_index: [B, S] int, token index (0-based, inclusive, within the
            response) of the LAST token of step j; -1 marks padding. In each
            row the real steps come first, strictly increasing and
            < response_len, followed only by -1. B = num_prompts * group_size,
            each group's G responses contiguous. S is the max step count; rows
            may have fewer steps (even none).
        response_len:   T, width of the returned per-token tensor.

    Each group's real step rewards are normalised together by their mean and
    sample std (same convention as ``group_advantages``):
    r~ = (r - mean) / (std + eps); all-equal (or single-step) groups give 0.
    A token t then gets A_t = sum of r~_j over steps j with end_j >= t, so
    tokens after a row's last step get 0.

    Returns:
        [B, T] float advantages (fp32 for integer rewards).
    """
    if not isinstance(step_rewards, Tensor) or step_rewards.dim() != 2:
        raise ValueError("step_rewards must be a 2-D tensor [B, S]")
    _same_shape(step_rewards, "step_rewards", step_end_index, "step_end_index")
    if step_end_index.is_floating_point() or step_end_index.dtype == torch.bool:
        raise ValueError(f"step_end_index must be integer, got {step_end_index.dtype}")
    if isinstance(response_len, bool) or not isinstance(response_len, int) or response_len < 1:
        raise ValueError(f"response_len must be a positive int, got {response_len!r}")
    b, s = step_rewards.shape
    _check_group_size(group_size, b, "step_rewards")
    ends = step_end_index.long()
    valid = ends >= 0
    if bool((ends >= response_len).any()) or bool((ends < -1).any()):
        raise ValueError(f"step_end_index must be in [0, response_len={response_len}) or -1 (padding)")
    if s > 1:
        if bool((valid[:, 1:] & ~valid[:, :-1]).any()):
            raise ValueError("step_end_index: padding (-1) must only trail the real steps of a row")
        if bool((valid[:, 1:] & (ends[:, 1:] <= ends[:, :-1])).any()):
            raise ValueError("step_end_index must be strictly increasing within a row")
    r = _float(step_rewards)
    if not bool(torch.isfinite(r[valid]).all()):
        raise ValueError("step_rewards contain NaN or inf at real steps")

    # Normalise over all real steps of the group: [P, G*S].
    r0 = torch.where(valid, r, torch.zeros_like(r))
    gr, gv = r0.view(-1, group_size * s), valid.view(-1, group_size * s)
    count = gv.sum(dim=1, keepdim=True)
    mean = gr.sum(dim=1, keepdim=True) / count.clamp(min=1)
    dev = torch.where(gv, gr - mean, torch.zeros_like(gr))
    std = (dev.square().sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
    big = torch.finfo(r.dtype).max
    equal = (torch.where(gv, gr, -big).amax(dim=1, keepdim=True)
             == torch.where(gv, gr, big).amin(dim=1, keepdim=True)) | (count <= 1)
    normed = torch.where(equal | ~gv, torch.zeros_like(dev), dev / (std + eps)).view(b, s)

    # A_t = sum_{j: end_j >= t} r~_j: drop each r~_j at its end token, then a
    # reverse cumulative sum over tokens. O(B*T), no [B, S, T] intermediate.
    at_end = torch.zeros(b, response_len, dtype=r.dtype, device=r.device)
    at_end.scatter_add_(1, ends.clamp(min=0), normed)
    return at_end.flip(1).cumsum(1).flip(1)


# ---------------------------------------------------------------------------
# KL estimators
# ---------------------------------------------------------------------------

def _k1(x: Tensor) -> Tensor:
    return x


def _k2(x: Tensor) -> Tensor:
    return 0.5 * x.square()


def _k3(x: Tensor) -> Tensor:
    # exp(-x) + x - 1 with expm1: no cancellation near x = 0, where it matters.
    return torch.expm1(-x) + x


def _kabs(x: Tensor) -> Tensor:
    return x.abs()


# Each takes x = logp - ref_logp on samples from pi_theta.
KL_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {"k1": _k1, "k2": _k2, "k3": _k3, "abs": _kabs}
KL_ALIASES: dict[str, str] = {"mse": "k2", "low_var_kl": "k3"}


def _kl_estimator(kind: str, arg: str = "kind") -> Callable[[Tensor], Tensor]:
    names = {**KL_ESTIMATORS, **{a: KL_ESTIMATORS[k] for a, k in KL_ALIASES.items()}}
    return _lookup(names, kind, arg)


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str, *,
               clamp: Optional[float] = None) -> Tensor:
    """Elementwise estimator of KL(pi_theta || pi_ref) on tokens sampled from pi_theta.

    With x = logp - ref_logp (same shape, any):
        k1  = x                          unbiased, high variance, can be < 0
        k2  = x^2 / 2        ("mse")     biased, low variance
        k3  = exp(-x) + x - 1 ("low_var_kl")  unbiased, >= 0 (GRPO's choice)
        abs = |x|

    clamp: if given, x is clamped to [-clamp, clamp] first, which keeps k3
        (exponential in -x) finite when the policy drifts far from the
        reference; gradients are zero where the clamp is active.
    Returns: KL estimate, same shape as logp.
    """
    if not isinstance(logp, Tensor):
        raise ValueError("logp must be a tensor")
    _same_shape(logp, "logp", ref_logp, "ref_logp")
    fn = _kl_estimator(kind)
    if clamp is not None and not clamp > 0:
        raise ValueError(f"clamp must be positive or None, got {clamp!r}")
    x = logp - ref_logp
    if clamp is not None:
        x = x.clamp(-clamp, clamp)
    return fn(x)


# ---------------------------------------------------------------------------
# aggregation
# ---------------------------------------------------------------------------

def _masked(values: Tensor, mask: Tensor) -> Tensor:
    # where, not multiply: inf/NaN at padded positions must not leak into sums.
    return torch.where(mask, values, torch.zeros_like(values))


def _agg_token_mean(v: Tensor, mask: Tensor, max_len) -> Tensor:
    return _masked(v, mask).sum()


def _agg_seq_mean_token_mean(v: Tensor, mask: Tensor, max_len) -> Tensor:
    # DeepSeekMath: 1/G sum_i 1/|o_i| sum_t; empty rows give 0/1 = 0, not NaN.
    lengths = mask.sum(dim=-1).clamp(min=1)
    return (_masked(v, mask).sum(dim=-1) / lengths).sum()


def _agg_seq_mean_token_sum(v: Tensor, mask: Tensor, max_len) -> Tensor:
    return _masked(v, mask).sum()


def _agg_seq_mean_token_sum_norm(v: Tensor, mask: Tensor, max_len) -> Tensor:
    # Dr. GRPO: a constant per-token weight 1/max_len removes the length bias
    # that 1/|o_i| introduces while keeping the loss scale independent of T.
    return _masked(v, mask).sum() / max_len


# name -> (numerator over this micro-batch, which count divides it)
AGGREGATIONS: dict[str, Tuple[Callable[[Tensor, Tensor, Optional[int]], Tensor], str]] = {
    "token-mean": (_agg_token_mean, "tokens"),
    "seq-mean-token-mean": (_agg_seq_mean_token_mean, "seqs"),
    "seq-mean-token-sum": (_agg_seq_mean_token_sum, "seqs"),
    "seq-mean-token-sum-norm": (_agg_seq_mean_token_sum_norm, "seqs"),
}


def _as_bool_mask(mask: Tensor) -> Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def _local_counts(mask: Tensor) -> Tuple[Tensor, Tensor]:
    """(valid tokens, non-empty sequences) of a bool mask [B, T]."""
    return mask.sum(), mask.any(dim=-1).sum()


def _check_count(count, name: str):
    if count is None:
        return None
    if isinstance(count, Tensor):
        if count.numel() != 1:
            raise ValueError(f"{name} must be a scalar, got shape {tuple(count.shape)}")
        return count.clamp(min=1)
    if isinstance(count, bool) or not isinstance(count, (int, float)) or count < 0:
        raise ValueError(f"{name} must be a non-negative number, got {count!r}")
    # A globally empty batch has a zero numerator; dividing by 1 keeps it 0, not NaN.
    return max(count, 1)


def aggregate(values: Tensor, mask: Tensor, mode: str, *, max_len: Optional[int] = None,
              global_tokens: Optional[Count] = None,
              global_seqs: Optional[Count] = None) -> Tensor:
    """Reduce per-token values [B, T] to this micro-batch's share of the loss.

    Args:
        values: [B, T] per-token values (e.g. per-token loss).
        mask: [B, T] bool (or 0/1) valid-token mask; nonzero means valid.
        mode: one of
            "token-mean":              sum_{i,t} v / N_tokens
            "seq-mean-token-mean":     sum_i (sum_t v / |o_i|) / N_seqs  (DeepSeekMath)
            "seq-mean-token-sum":      sum_{i,t} v / N_seqs
            "seq-mean-token-sum-norm": sum_{i,t} v / (N_seqs * max_len)  (Dr. GRPO)
        max_len: constant length normaliser, required by seq-mean-token-sum-norm
            (use the generation budget, the same for every batch).
        global_tokens / global_seqs: N_tokens / N_seqs over the WHOLE global
            batch (all micro-batches, all DP ranks; see ``global_batch_counts``).
            None means this micro-batch's own count (correct only when it is
            the whole global batch). N_seqs counts sequences with at least one
            valid token: empty responses contribute nothing anywhere.

    Returns:
        0-d tensor. Summing it over micro-batches and DP ranks gives the
        global-batch value, so gradients must be summed, not averaged.
    """
    if not isinstance(values, Tensor) or values.dim() != 2:
        raise ValueError("values must be a 2-D tensor [B, T]")
    _same_shape(values, "values", mask, "mask")
    numerator_fn, count_kind = _lookup(AGGREGATIONS, mode, "mode")
    if mode == "seq-mean-token-sum-norm":
        if max_len is None or isinstance(max_len, bool) or not max_len > 0:
            raise ValueError(f"max_len must be a positive number for mode={mode!r}, got {max_len!r}")
    tokens = _check_count(global_tokens, "global_tokens")
    seqs = _check_count(global_seqs, "global_seqs")
    mask = _as_bool_mask(mask)
    numerator = numerator_fn(values, mask, max_len)
    denominator = tokens if count_kind == "tokens" else seqs
    if denominator is None:
        local_tokens, local_seqs = _local_counts(mask)
        denominator = (local_tokens if count_kind == "tokens" else local_seqs).clamp(min=1)
    return numerator / denominator


def global_batch_counts(mask: Union[Tensor, Sequence[Tensor]], dp_group=None) -> Tuple[int, int]:
    """(global_tokens, global_seqs) for ``aggregate`` / ``policy_loss``.

    Args:
        mask: this DP rank's whole step batch: one [B, T] mask, or a list of
            per-micro-batch [B_i, T_i] masks (lengths may differ).
        dp_group: the group the global batch is split over (DP, or DP x CP
            when context parallel splits sequences); None for a single rank.
            Every rank of the group must call this (one all-reduce).

    Returns:
        Python ints: valid tokens, and sequences with at least one valid token,
        summed over the group. Call once per step, before the micro-batch loop.
    """
    masks = [mask] if isinstance(mask, Tensor) else list(mask)
    if not masks or not all(isinstance(m, Tensor) and m.dim() == 2 for m in masks):
        raise ValueError("mask must be a 2-D tensor [B, T] or a non-empty list of them")
    counts = torch.zeros(2, dtype=torch.int64, device=masks[0].device)
    for m in masks:
        t, s = _local_counts(_as_bool_mask(m))
        counts[0] += t
        counts[1] += s
    _all_reduce(counts, dist.ReduceOp.SUM, dp_group)
    tokens, seqs = counts.tolist()
    return tokens, seqs


# ---------------------------------------------------------------------------
# GRPO loss
# ---------------------------------------------------------------------------

def _check_token_tensor(ref: Tensor, t: Optional[Tensor], name: str) -> None:
    if t is not None:
        _same_shape(ref, "logp", t, name)


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return (_masked(x.float(), mask).sum() / mask.sum().clamp(min=1)).detach()


def policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
                clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: Optional[float] = None,
                agg: str = "token-mean", ref_logp: Optional[Tensor] = None, kl_coef: float = 0.0,
                kl_kind: str = "k3", rollout_logp: Optional[Tensor] = None,
                tis_cap: Optional[float] = None, entropy: Optional[Tensor] = None,
                max_len: Optional[int] = None, global_tokens: Optional[Count] = None,
                global_seqs: Optional[Count] = None) -> Tuple[Tensor, dict]:
    """GRPO objective to MINIMISE for one micro-batch.

    Per valid token, with r = exp(logp - old_logp) and advantage A:
        pg  = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))     (clip-higher
              when clip_high > clip_low, DAPO)
        pg  = min(pg, -A dual_clip)  where A < 0   (dual-clip: bounds the loss of
              a bad action whose ratio exploded; dual_clip > 1)
        pg *= w = min(exp(old_logp - rollout_logp), tis_cap), detached, when
              rollout_logp is given (truncated importance sampling: corrects for
              the rollout engine's sampler differing from the trainer's
              numerics; tis_cap=None means no truncation, high variance)
        tok = pg + kl_coef * kl_penalty(logp, ref_logp, kl_kind)
    loss = aggregate(tok, mask, agg, ...). The TIS weight multiplies only the
    surrogate: the KL term is a regulariser on the current samples (as in verl).

    Args:
        logp: [B, T] current-policy log-probs (differentiable).
        old_logp: [B, T] log-probs of the policy that is being improved on
            (behaviour policy as the trainer computes it), no grad needed.
        advantages: [B, T] per token, or [B] per sequence (expanded over T;
            the only broadcast allowed).
        mask: [B, T] bool (or 0/1) valid response tokens.
        ref_logp: [B, T] reference log-probs; required when kl_coef != 0.
        rollout_logp: [B, T] log-probs reported by the rollout engine.
        entropy: [B, T] per-token entropy, logged only (no bonus in the loss).
        agg, max_len, global_tokens, global_seqs: see ``aggregate``.

    Returns:
        (loss, metrics). loss: 0-d tensor, this micro-batch's share of the
        global loss. metrics: 0-d detached tensors; ``pg_loss`` / ``kl_loss``
        are shares like the loss (sum them over micro-batches and ranks), the
        others are means over this micro-batch's valid tokens:
        ``clipfrac_low`` / ``clipfrac_high`` (tokens where the lower / upper
        clip removed the gradient), ``dual_clipfrac``, ``ratio_mean``, ``kl``,
        ``entropy``, ``rollout_logp_gap`` (mean |old_logp - rollout_logp|),
        ``tis_weight_mean``, ``tis_clipfrac``.
    """
    if not isinstance(logp, Tensor) or logp.dim() != 2:
        raise ValueError("logp must be a 2-D tensor [B, T]")
    _same_shape(logp, "logp", old_logp, "old_logp")
    _same_shape(logp, "logp", mask, "mask")
    for t, name in ((ref_logp, "ref_logp"), (rollout_logp, "rollout_logp"), (entropy, "entropy")):
        _check_token_tensor(logp, t, name)
    if not isinstance(advantages, Tensor) or advantages.shape not in (logp.shape, logp.shape[:1]):
        got = tuple(advantages.shape) if isinstance(advantages, Tensor) else type(advantages).__name__
        raise ValueError(f"advantages must have shape [B, T]={tuple(logp.shape)} or "
                         f"[B]={tuple(logp.shape[:1])}, got {got}")
    if not 0 <= clip_low < 1:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low!r}")
    if not clip_high >= 0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high!r}")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip must be > 1 or None, got {dual_clip!r}")
    if tis_cap is not None and not tis_cap > 0:
        raise ValueError(f"tis_cap must be > 0 or None, got {tis_cap!r}")
    if tis_cap is not None and rollout_logp is None:
        raise ValueError("tis_cap needs rollout_logp")
    if kl_coef != 0 and ref_logp is None:
        raise ValueError(f"ref_logp is required when kl_coef={kl_coef!r} is nonzero")
    kl_fn = _kl_estimator(kl_kind, "kl_kind")  # fail on a bad name even when the KL term is off
    _lookup(AGGREGATIONS, agg, "agg")

    mask = _as_bool_mask(mask)
    adv = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(logp)
    adv = adv.detach().to(logp.dtype)
    # Zero the log-ratio at padding BEFORE exp: garbage there must not become
    # inf, whose 0-weighted gradient would still be NaN.
    log_ratio = torch.where(mask, logp - old_logp.detach(), torch.zeros_like(logp))
    ratio = log_ratio.exp()
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    if dual_clip is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * dual_clip), pg)

    metrics: dict = {}
    with torch.no_grad():
        metrics["clipfrac_low"] = _masked_mean(((adv < 0) & (ratio < 1 - clip_low)).float(), mask)
        metrics["clipfrac_high"] = _masked_mean(((adv > 0) & (ratio > 1 + clip_high)).float(), mask)
        if dual_clip is not None:
            metrics["dual_clipfrac"] = _masked_mean(((adv < 0) & (ratio > dual_clip)).float(), mask)
        metrics["ratio_mean"] = _masked_mean(ratio, mask)
        if entropy is not None:
            metrics["entropy"] = _masked_mean(entropy, mask)

    if rollout_logp is not None:
        with torch.no_grad():
            gap = torch.where(mask, old_logp - rollout_logp, torch.zeros_like(old_logp))
            weight = gap.exp()
            if tis_cap is not None:
                metrics["tis_clipfrac"] = _masked_mean((weight > tis_cap).float(), mask)
                weight = weight.clamp(max=tis_cap)
            metrics["rollout_logp_gap"] = _masked_mean(gap.abs(), mask)
            metrics["tis_weight_mean"] = _masked_mean(weight, mask)
        pg = pg * weight.to(pg.dtype)

    counts = dict(max_len=max_len, global_tokens=global_tokens, global_seqs=global_seqs)
    loss = aggregate(pg, mask, agg, **counts)
    metrics["pg_loss"] = loss.detach().clone()
    if ref_logp is not None:
        # Same zero-at-padding guard as the ratio: k3 is exponential in -x.
        ref_log_ratio = torch.where(mask, logp - ref_logp.detach(), torch.zeros_like(logp))
        kl = kl_fn(ref_log_ratio)
        metrics["kl"] = _masked_mean(kl.detach(), mask)
        if kl_coef != 0:
            kl_loss = aggregate(kl, mask, agg, **counts)
            metrics["kl_loss"] = kl_loss.detach().clone()
            loss = loss + kl_coef * kl_loss
    return loss, metrics
