"""Vocab-parallel log-probs, entropy and KL: exact per-token values from vocab shards.

What
    Under Megatron tensor parallelism (TP) each rank holds a slice of the
    vocabulary, ``logits: [..., V/tp]``. ``vocab_parallel_logprobs`` /
    ``vocab_parallel_entropy`` / ``vocab_parallel_kl`` return the exact per-token
    log pi(y), H(pi) and KL(pi_theta || pi_ref) over the FULL vocabulary, with
    analytic backwards (three ``torch.autograd.Function``\\ s).

Why
    megatron-core 0.19.2 has vocab-parallel cross-entropy but no log-prob or
    entropy helper, and gathering the full vocabulary costs tp x memory. Each
    function here does two small all-reduces over [tokens] (a MAX, then one
    stacked SUM) in the forward and NONE in the backward: the gradient of each
    quantity w.r.t. the local shard only needs per-token statistics already
    reduced in the forward. Differentiating through ``exp(z - logZ)`` on a shard
    instead would miss the cross-shard terms of d logZ / dz and give wrong
    gradients at TP > 1 while passing at TP = 1.

Memory
    The forward saves the input logits (a reference, no copy; logp, entropy and
    KL of the same logits share it) and O(tokens) statistics. The backward
    computes in place in the gradient it returns, the one shard-sized buffer;
    the only other temporaries are one [chunk, V/tp] buffer for the KL backward
    and, for bf16/fp16 logits, one fp32 [chunk, V/tp] buffer. The forward's
    temporaries are [chunk, V/tp] too. ``chunk_size`` (tokens per chunk; None =
    all tokens at once) therefore bounds peak extra memory at one shard plus
    O(chunk_size x V/tp), not tokens x vocab; chunking changes no result bit
    (tested). bf16/fp16 logits are upcast one chunk at a time; results are fp32
    and gradients come back in the logits' dtype. ``temperature`` and ``vocab_size``
    (the sampling distribution softmax(mask(logits) / T)) are applied per chunk too, so
    the caller passes the raw shard and never builds a masked, upcast, scaled copy.

Conventions
    The vocabulary is split in rank order in equal contiguous shards, as
    megatron's ``VocabParallelEmbedding`` / output layer does. All TP ranks must
    pass the same token layout and targets. Padded vocabulary entries (megatron
    pads V to a multiple of 128 x tp) are part of the softmax unless ``vocab_size``
    names the real vocabulary.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from grpo_mega.algorithms._checks import Tensor, _all_reduce, _check_logits, _same_shape, _tp_size_rank

__all__ = ["vocab_parallel_logprobs", "vocab_parallel_entropy", "vocab_parallel_kl"]


def _chunks(n: int, chunk_size: Optional[int]):
    """Yield (start, end) token ranges; chunk_size=None means one chunk."""
    step = n if chunk_size is None else chunk_size
    for s in range(0, n, max(step, 1)):
        yield s, min(s + step, n)


def _check_chunk_size(chunk_size) -> None:
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")


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


# Precision: the per-row statistics are kept as (max m, sum S) and combined in
# fp64 (O(tokens) work). Folding them into one fp32 logZ = m + log S would round at ulp(|logZ|)
# (~1e-6 for logits of a few units) and that error lands on every output and
# gradient; (z - m) is exact for the tokens that dominate the softmax.

def _row(t: Tensor) -> Tensor:
    return t.double()


# The sampling distribution is softmax(mask(logits) / T): padded vocabulary columns pushed
# to a finite huge negative value and the temperature folded in. It is applied here one
# [chunk, V/tp] block at a time, in the compute dtype, so the caller never builds a
# masked, upcast, scaled copy of the whole shard. Each step is the same elementwise op
# (same dtype, same order) as ``mask_vocab_padding(logits).to(cdt) / T``, so the values
# are bit for bit those of the full-shard copy.

class _Sampling(NamedTuple):
    """How raw shard logits map to the sampling distribution's logits."""

    temperature: Optional[float]  # divide by it; None: 1 (0 and 1 both mean unscaled)
    keep: int                     # local columns [0, keep) are real vocabulary, the rest padding
    fill: float                   # the padded columns' value, before the temperature


def _pad_fill(dtype: torch.dtype) -> float:
    """-1e9 for fp32 logits, -1e4 otherwise (as ``models.mask_vocab_padding``), rounded to
    ``dtype`` as a masked fill in that dtype would be; finite, so p log p = 0, not NaN."""
    return torch.tensor(-1e9 if dtype == torch.float32 else -1e4, dtype=dtype).item()


def _sampling(logits_shard: Tensor, temperature: float, vocab_size: Optional[int],
              tp_group) -> Optional[_Sampling]:
    """The transform for ``logits_shard: [..., V/tp]`` of rank r (global columns
    [r V/tp, (r+1) V/tp)); None when it is the identity (no padding here, T in {0, 1})."""
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature!r}")
    tp, rank = _tp_size_rank(tp_group)
    cols = logits_shard.shape[-1]
    vocab = cols * tp if vocab_size is None else int(vocab_size)
    if not 0 < vocab <= cols * tp:
        raise ValueError(f"vocab_size={vocab_size} must be in (0, {cols * tp}] (V/tp={cols}, tp={tp})")
    keep = min(max(vocab - rank * cols, 0), cols)
    temp = None if temperature in (0.0, 1.0) else float(temperature)
    if temp is None and keep == cols:
        return None
    return _Sampling(temp, keep, _pad_fill(logits_shard.dtype))


def _sampling_rows(z: Tensor, s: int, e: int, tf: Optional[_Sampling], cdt: torch.dtype,
                   out: Optional[Tensor] = None) -> Tensor:
    """Rows ``s:e`` of the raw shard ``z: [N, V/tp]`` as sampling logits ``[e-s, V/tp]`` in
    ``cdt``, written into ``out`` (a [e-s, V/tp] cdt buffer) when given. Without ``out``,
    and with no transform and z already in cdt, the rows themselves (a view, read only)."""
    rows = z[s:e]
    if out is None:
        if tf is None and rows.dtype == cdt:
            return rows
        out = torch.empty(rows.shape, dtype=cdt, device=z.device)
    out.copy_(rows)
    if tf is not None:
        out[:, tf.keep:] = tf.fill
        if tf.temperature is not None:
            out.div_(tf.temperature)
    return out


def _sampling_row_max(z: Tensor, tf: Optional[_Sampling], cdt: torch.dtype) -> Tensor:
    """Per-row max of the sampling logits of ``z: [N, V/tp]`` -> [N] cdt. Division by T > 0
    is monotone and the fill is exact in cdt, so this is max(real columns, fill) / T, with
    no [N, V/tp] temporary."""
    if tf is None:
        return z.amax(dim=-1).to(cdt)
    if tf.keep:
        m = z[:, :tf.keep].amax(dim=-1).to(cdt)
        if tf.keep < z.shape[1]:
            m.clamp_(min=tf.fill)
    else:
        m = torch.full(z.shape[:1], tf.fill, dtype=cdt, device=z.device)
    return m if tf.temperature is None else m.div_(tf.temperature)


def _sampling_values(v: Tensor, local: Tensor, tf: Optional[_Sampling], cdt: torch.dtype) -> Tensor:
    """Raw logits ``v: [N]`` at local columns ``local: [N]`` -> their sampling logits, cdt."""
    v = v.to(cdt)
    if tf is None:
        return v
    v = torch.where(local >= tf.keep, torch.full_like(v, tf.fill), v)
    return v if tf.temperature is None else v.div_(tf.temperature)


def _sampling_grad_(buf: Tensor, tf: Optional[_Sampling]) -> Tensor:
    """The chain rule of the transform, in place on ``buf: [n, V/tp]``, d/d(sampling
    logits) -> d/d(raw logits): 0 on padded columns, divided by T (as autograd through
    masked_fill and ``/ T`` would give)."""
    if tf is not None:
        if tf.temperature is not None:
            buf.div_(tf.temperature)
        buf[:, tf.keep:] = 0
    return buf


def _shifted(z: Tensor, s: int, e: int, tf: Optional[_Sampling], cdt: torch.dtype,
             m: Tensor) -> Tensor:
    """Sampling logits of rows ``s:e`` minus their row max ``m: [N]``: a fresh [e-s, V/tp] cdt buffer."""
    x = _sampling_rows(z, s, e, tf, cdt)
    return torch.sub(x, m[s:e, None]) if x.data_ptr() == z[s:e].data_ptr() else x.sub_(m[s:e, None])


def _grad_rows(grad: Tensor, s: int, e: int, cdt: torch.dtype) -> tuple[Tensor, Tensor]:
    """(rows s:e of the returned gradient, a cdt buffer to compute them in: those rows
    themselves when the dtypes agree)."""
    out = grad[s:e]
    return out, (out if out.dtype == cdt else torch.empty(out.shape, dtype=cdt, device=grad.device))


class _VocabParallelLogprobs(torch.autograd.Function):
    """log_softmax(x)[y] over the full vocab from shards, x the sampling logits of the
    raw shard z (``_Sampling``).  z: [N, V/tp], y: [N]."""

    @staticmethod
    def forward(ctx, z: Tensor, targets: Tensor, group, chunk_size, tf):
        cdt = _compute_dtype(z)
        n, vs = z.shape
        _, rank = _tp_size_rank(group)
        local = targets - rank * vs
        in_shard = (local >= 0) & (local < vs)
        idx = torch.where(in_shard, local, torch.zeros_like(local))

        # Any per-row constant works for stability; the global max makes exp <= 1.
        m = _all_reduce(_sampling_row_max(z, tf, cdt), dist.ReduceOp.MAX, group)
        stats = torch.empty(2, n, dtype=cdt, device=z.device)  # [S = sum exp(x - m), x_target]
        for s, e in _chunks(n, chunk_size):
            stats[0, s:e] = _shifted(z, s, e, tf, cdt, m).exp_().sum(dim=-1)
        picked = _sampling_values(z.gather(1, idx[:, None]).squeeze(1), idx, tf, cdt)
        stats[1] = torch.where(in_shard, picked, torch.zeros_like(picked))
        _all_reduce(stats, dist.ReduceOp.SUM, group)

        ctx.save_for_backward(z, idx, in_shard, m, stats[0])
        ctx.chunk_size, ctx.tf = chunk_size, tf
        return ((_row(stats[1]) - _row(m)) - _row(stats[0]).log()).to(cdt)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        z, idx, in_shard, m, sum_exp = ctx.saved_tensors
        cdt, tf = m.dtype, ctx.tf
        g = grad_out.to(cdt)
        # d logp / dx = onehot(y) - exp(x - m) / S: the softmax part needs only (m, S).
        coef = (-_row(g) / _row(sum_exp)).to(cdt)[:, None]
        grad = torch.empty_like(z)
        for s, e in _chunks(z.shape[0], ctx.chunk_size):
            out, buf = _grad_rows(grad, s, e, cdt)
            _sampling_rows(z, s, e, tf, cdt, out=buf).sub_(m[s:e, None]).exp_().mul_(coef[s:e])
            buf.scatter_add_(1, idx[s:e, None], (g[s:e] * in_shard[s:e])[:, None])
            _sampling_grad_(buf, tf)
            if buf is not out:
                out.copy_(buf)
        return grad, None, None, None, None


class _VocabParallelEntropy(torch.autograd.Function):
    """H = -sum p log p over the full vocab from shards, p = softmax of the sampling
    logits of z.  z: [N, V/tp] -> [N]."""

    @staticmethod
    def forward(ctx, z: Tensor, group, chunk_size, tf):
        cdt = _compute_dtype(z)
        n = z.shape[0]
        m = _all_reduce(_sampling_row_max(z, tf, cdt), dist.ReduceOp.MAX, group)
        stats = torch.empty(2, n, dtype=cdt, device=z.device)  # [S = sum e, A = sum e (x - m)]
        for s, e in _chunks(n, chunk_size):
            shifted = _shifted(z, s, e, tf, cdt, m)
            ex = shifted.exp()
            stats[0, s:e] = ex.sum(dim=-1)
            stats[1, s:e] = shifted.mul_(ex).sum(dim=-1)
        _all_reduce(stats, dist.ReduceOp.SUM, group)

        # With p = e / S and e = exp(x - m):  H = log S - A / S.
        log_s = _row(stats[0]).log()
        ent = log_s - _row(stats[1]) / _row(stats[0])
        ctx.save_for_backward(z, m, (log_s - ent).to(cdt), ent.to(cdt))
        ctx.chunk_size, ctx.tf = chunk_size, tf
        return ent.to(cdt)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        z, m, log_s_minus_h, ent = ctx.saved_tensors
        cdt, tf = m.dtype, ctx.tf
        # dH/dx = -p (log p + H).  With q = p e^H = exp((x - m) - (log S - H)):
        # p (log p + H) = e^-H q log q, so one buffer holds q and then q log q
        # (xlogy keeps p = 0 at 0, not NaN).
        coef = (-_row(grad_out) * torch.exp(-_row(ent))).to(cdt)[:, None]
        shift = log_s_minus_h[:, None]
        grad = torch.empty_like(z)
        for s, e in _chunks(z.shape[0], ctx.chunk_size):
            out, buf = _grad_rows(grad, s, e, cdt)
            _sampling_rows(z, s, e, tf, cdt, out=buf).sub_(m[s:e, None]).sub_(shift[s:e]).exp_()
            buf.xlogy_(buf).mul_(coef[s:e])
            _sampling_grad_(buf, tf)
            if buf is not out:
                out.copy_(buf)
        return grad, None, None, None


class _VocabParallelKL(torch.autograd.Function):
    """KL(softmax(x) || softmax(x_ref)) over the full vocab, x and x_ref the sampling logits
    of z and y (the same ``_Sampling``).  z, y: [N, V/tp] -> [N]."""

    @staticmethod
    def forward(ctx, z: Tensor, y: Tensor, group, chunk_size, tf):
        cdt = _compute_dtype(z, y)
        n = z.shape[0]
        maxes = torch.stack([_sampling_row_max(z, tf, cdt), _sampling_row_max(y, tf, cdt)])
        _all_reduce(maxes, dist.ReduceOp.MAX, group)
        mz, my = maxes[0], maxes[1]
        stats = torch.empty(3, n, dtype=cdt, device=z.device)  # [Sz, Sy, sum ez (x - x_ref)]
        for s, e in _chunks(n, chunk_size):
            xz, xy = _sampling_rows(z, s, e, tf, cdt), _sampling_rows(y, s, e, tf, cdt)
            ez = torch.sub(xz, mz[s:e, None]).exp_()
            stats[0, s:e] = ez.sum(dim=-1)
            tmp = torch.sub(xy, my[s:e, None]).exp_()
            stats[1, s:e] = tmp.sum(dim=-1)
            _sub_into(xz, xy, tmp)
            stats[2, s:e] = tmp.mul_(ez).sum(dim=-1)
        _all_reduce(stats, dist.ReduceOp.SUM, group)

        # log p - log q = (x - x_ref) - c  with  c = (mz - my) + log Sz - log Sy,
        # so KL = E_p[x - x_ref] - c.
        sz, sy = _row(stats[0]), _row(stats[1])
        c = (_row(mz) - _row(my)) + (sz.log() - sy.log())
        kl = _row(stats[2]) / sz - c
        ctx.save_for_backward(z, y, mz, stats[0], (c + kl).to(cdt))
        ctx.chunk_size, ctx.tf = chunk_size, tf
        return kl.to(cdt)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        z, y, mz, sum_ez, offset = ctx.saved_tensors
        cdt, tf = mz.dtype, ctx.tf
        # dKL/dx = p (log p - log q - KL) = (ez / Sz) ((x - x_ref) - (c + KL));
        # the E_p[d log p / dx] term vanishes.
        coef = (_row(grad_out) / _row(sum_ez)).to(cdt)[:, None]
        grad = torch.empty_like(z)
        for s, e in _chunks(z.shape[0], ctx.chunk_size):
            out, buf = _grad_rows(grad, s, e, cdt)
            xz, xy = _sampling_rows(z, s, e, tf, cdt), _sampling_rows(y, s, e, tf, cdt)
            _sub_into(xz, xy, buf).sub_(offset[s:e, None])
            p = torch.sub(xz, mz[s:e, None]).exp_().mul_(coef[s:e])
            buf.mul_(p)
            _sampling_grad_(buf, tf)
            if buf is not out:
                out.copy_(buf)
        return grad, None, None, None, None


def vocab_parallel_logprobs(logits_shard: Tensor, targets: Tensor, tp_group=None, *,
                            chunk_size: Optional[int] = None, temperature: float = 1.0,
                            vocab_size: Optional[int] = None) -> Tensor:
    """Exact log_softmax(logits / T)[target] over the full vocabulary, from a vocab shard.

    Args:
        logits_shard: [..., V/tp] this rank's vocab slice (rank r holds ids
            [r*V/tp, (r+1)*V/tp)). Any float dtype; bf16/fp16 are upcast to fp32.
        targets: [...] GLOBAL token ids in [0, V), same leading shape as the logits.
            Padding positions need a valid id (e.g. 0, not -100); mask their
            log-probs afterwards (``policy_loss`` / ``aggregate`` take the mask).
        tp_group: tensor-parallel process group, or None for a single rank.
        chunk_size: tokens per chunk to bound the [chunk, V/tp] temporaries.
        temperature: the sampling temperature T: values are of softmax(logits / T)
            (0 and 1 both mean unscaled, as vLLM's greedy log-probs are of the raw logits).
        vocab_size: the real vocabulary; columns with global id >= vocab_size (megatron's
            padding) are set to a huge negative finite value first (-1e9 for fp32
            logits, -1e4 otherwise), so they get probability 0. Default: all columns.
            Both are applied one chunk at a time: no transformed copy of the shard is
            made, and the gradient w.r.t. the raw logits is 0 on padded columns.

    Returns:
        [...] log-probs, fp32 (fp64 for fp64 logits). Differentiable w.r.t.
        ``logits_shard``; the backward needs no communication.
    """
    _check_logits(logits_shard, "logits_shard")
    _check_chunk_size(chunk_size)
    tf = _sampling(logits_shard, temperature, vocab_size, tp_group)
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
                                       tp_group, chunk_size, tf)
    return out.view(targets.shape)


def vocab_parallel_entropy(logits_shard: Tensor, tp_group=None, *,
                           chunk_size: Optional[int] = None, temperature: float = 1.0,
                           vocab_size: Optional[int] = None) -> Tensor:
    """Exact per-token entropy of softmax(logits / T) over the full vocabulary.

    Args:
        logits_shard: [..., V/tp] this rank's vocab slice.
        tp_group: tensor-parallel process group, or None for a single rank.
        chunk_size: tokens per chunk to bound the [chunk, V/tp] temporaries.
        temperature, vocab_size: the sampling distribution, as in ``vocab_parallel_logprobs``.

    Returns:
        [...] entropy in nats, fp32 (fp64 for fp64 logits), with the analytic
        gradient dH/dz = -p (log p + H) (no communication in the backward).
    """
    _check_logits(logits_shard, "logits_shard")
    _check_chunk_size(chunk_size)
    tf = _sampling(logits_shard, temperature, vocab_size, tp_group)
    out = _VocabParallelEntropy.apply(_flat(logits_shard), tp_group, chunk_size, tf)
    return out.view(logits_shard.shape[:-1])


def vocab_parallel_kl(logits_shard: Tensor, ref_logits_shard: Tensor, tp_group=None, *,
                      chunk_size: Optional[int] = None, temperature: float = 1.0,
                      vocab_size: Optional[int] = None) -> Tensor:
    """Exact per-token KL(pi_theta || pi_ref) = sum_v p (log p - log q) (verl's ``full``),
    p and q the softmax of each policy's logits / T.

    Args:
        logits_shard: [..., V/tp] policy logits, this rank's vocab slice.
        ref_logits_shard: [..., V/tp] reference logits, same shape. Treated as
            constant: no gradient flows to it.
        tp_group: tensor-parallel process group, or None for a single rank.
        chunk_size: tokens per chunk to bound the [chunk, V/tp] temporaries.
        temperature, vocab_size: the sampling distribution, as in
            ``vocab_parallel_logprobs``, applied to both logits.

    Returns:
        [...] KL in nats, fp32 (fp64 for fp64 inputs), differentiable w.r.t.
        the policy logits: dKL/dz = p (log p - log q - KL).
    """
    _check_logits(logits_shard, "logits_shard")
    _check_logits(ref_logits_shard, "ref_logits_shard")
    _same_shape(logits_shard, "logits_shard", ref_logits_shard, "ref_logits_shard")
    _check_chunk_size(chunk_size)
    tf = _sampling(logits_shard, temperature, vocab_size, tp_group)
    if tf is not None and ref_logits_shard.dtype != logits_shard.dtype:
        raise ValueError(f"ref_logits_shard is {ref_logits_shard.dtype} but logits_shard is "
                         f"{logits_shard.dtype}; with a temperature or vocab_size both need one dtype")
    out = _VocabParallelKL.apply(_flat(logits_shard), _flat(ref_logits_shard.detach()),
                                 tp_group, chunk_size, tf)
    return out.view(logits_shard.shape[:-1])

