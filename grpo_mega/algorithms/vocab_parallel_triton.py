"""Fused vocab-parallel log-prob and entropy on a logits shard (Triton), for the GRPO update.

What
    ``fused_logprobs_entropy(logits_shard, targets, tp_group, temperature=, vocab_size=)``
    returns per-token ``log pi(y)`` and entropy ``H(pi)`` of ``softmax(logits / T)``
    over the full vocabulary, from this rank's vocab shard, with the gradient of
    both w.r.t. the logits. It computes exactly what ``grpo_mega.algorithms``
    computes on ``mask_vocab_padding(logits).float() / T`` (same statistics, same
    two all-reduces, same analytic backward); ``tests/unit/algorithms/test_vocab_parallel_triton.py`` checks
    values and gradients against it at TP=1 and TP=2.

Why
    The unfused path on bf16 logits materialises a masked copy, an fp32 copy
    and a temperature-scaled copy of the ``[tokens, V/tp]`` shard, then reads
    it once for the max and once per statistic. Here one kernel reads the bf16
    shard once (online max with rescaling, padding columns and 1/T applied on
    load) to produce four numbers per token, and one backward kernel reads it
    once more and writes the gradient in the logits' dtype. No shard-sized
    temporary exists besides that gradient.

How
    Forward kernel, one program per token, looping over the shard in blocks:
    local max ``m``, ``S = sum exp(z - m)``, ``A = sum exp(z - m)(z - m)`` and the
    target's logit. Across TP: MAX all-reduce of ``m``, each rank rescales its
    (S, A) to the global max, SUM all-reduce of (S, A, z_y). Then
    ``logp = z_y - M - log S`` and ``H = log S - A / S``. Backward, with
    ``p = exp(z/T - M - log S)``: ``dz = (g_lp (onehot - p) - g_H p (log p + H)) / T``;
    it needs only per-token statistics, so no communication.

Availability: CUDA tensors with Triton importable. With ``TRITON_INTERPRET=1`` set
before Triton is imported, the same kernels run on CPU tensors through Triton's
interpreter (slowly): that is how CI checks them without a GPU.
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from grpo_mega.algorithms._checks import _all_reduce, _check_logits, _tp_size_rank

Tensor = torch.Tensor

try:  # optional: GPU machines have Triton; the CPU venv keeps it for the interpreter
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - any import failure means "not available"
    triton = None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def fused_available(device: torch.device) -> bool:
    """Can the Triton kernels run on tensors of ``device``?"""
    if triton is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


def use_fused(kernel: str, device: torch.device) -> bool:
    """Resolve ``algorithm.logprob_kernel`` (auto/torch/triton) for tensors on ``device``.
    ``auto`` never picks the interpreter: on CPU it is far slower than the torch path."""
    if kernel == "auto":
        return device.type == "cuda" and fused_available(device)
    return kernel == "triton"


if triton is not None:
    @triton.jit
    def _stats_kernel(Z, TGT, STATS, rows_per_b, stride_b, stride_t, n_cols, vocab_start,
                      vocab_size, inv_temp, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # offsets of >= 2^31 logits overflow int32
        base = Z + (row // rows_per_b) * stride_b + (row % rows_per_b) * stride_t
        # A finite start keeps exp(m - m_new) defined when a block is all padding.
        m = tl.full((), -1e30, tl.float32)
        s = tl.zeros((), tl.float32)
        a = tl.zeros((), tl.float32)
        for off in range(0, n_cols, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            valid = (cols < n_cols) & (vocab_start + cols < vocab_size)
            z = tl.load(base + cols, mask=valid, other=float("-inf")).to(tl.float32) * inv_temp
            m_new = tl.maximum(m, tl.max(z, 0))
            scale = tl.exp(m - m_new)
            zm = tl.where(valid, z - m_new, 0.0)
            e = tl.where(valid, tl.exp(zm), 0.0)
            a = scale * (a + s * (m - m_new)) + tl.sum(e * zm, 0)
            s = scale * s + tl.sum(e, 0)
            m = m_new
        local = tl.load(TGT + row) - vocab_start
        hit = (local >= 0) & (local < n_cols) & (vocab_start + local < vocab_size)
        zt = tl.load(base + tl.where(hit, local, 0)).to(tl.float32) * inv_temp
        tl.store(STATS + row * 5 + 0, m)
        tl.store(STATS + row * 5 + 1, s)
        tl.store(STATS + row * 5 + 2, a)
        tl.store(STATS + row * 5 + 3, tl.where(hit, zt, 0.0))
        tl.store(STATS + row * 5 + 4, hit.to(tl.float32))

    @triton.jit
    def _grad_kernel(Z, TGT, ROWSTATS, GLP, GENT, G, rows_per_b, stride_b, stride_t, n_cols,
                     vocab_start, vocab_size, inv_temp, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # offsets of >= 2^31 logits overflow int32
        base = Z + (row // rows_per_b) * stride_b + (row % rows_per_b) * stride_t
        shift = tl.load(ROWSTATS + row * 2 + 0)  # M + log S: log p = z/T - shift
        ent = tl.load(ROWSTATS + row * 2 + 1)
        g_lp = tl.load(GLP + row)
        g_ent = tl.load(GENT + row)
        local = tl.load(TGT + row) - vocab_start
        for off in range(0, n_cols, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            inside = cols < n_cols
            valid = inside & (vocab_start + cols < vocab_size)
            z = tl.load(base + cols, mask=valid, other=0.0).to(tl.float32) * inv_temp
            logp = z - shift
            p = tl.where(valid, tl.exp(logp), 0.0)
            onehot = tl.where(cols == local, 1.0, 0.0)
            d = g_lp * (onehot - p) - g_ent * tl.where(valid, p * (logp + ent), 0.0)
            tl.store(G + row * n_cols + cols, (d * inv_temp).to(G.dtype.element_ty), mask=inside)


def _block(n_cols: int, block: Optional[int]) -> int:
    if block is not None:
        return block
    return min(2048, triton.next_power_of_2(max(n_cols, 16)))


def _rows_view(z: Tensor) -> Tuple[Tensor, int, int, int]:
    """z: [B, S, V] or [N, V] with unit stride on V -> (z, rows_per_b, stride_b, stride_t)."""
    if z.stride(-1) != 1:
        z = z.contiguous()
    if z.dim() == 2:
        return z, 1, z.stride(0), 0
    return z, z.shape[1], z.stride(0), z.stride(1)


class _FusedLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z: Tensor, targets: Tensor, group, vocab_start: int, vocab_size: int,
                inv_temp: float, block: int):
        z, rows_per_b, sb, st = _rows_view(z)
        n_rows, n_cols = targets.numel(), z.shape[-1]
        stats = torch.empty(n_rows, 5, dtype=torch.float32, device=z.device)
        if n_rows:
            _stats_kernel[(n_rows,)](z, targets, stats, rows_per_b, sb, st, n_cols, vocab_start,
                                     vocab_size, inv_temp, BLOCK=block)
        m, s, a, zt = (stats[:, i].double() for i in range(4))
        # Combine the shards in fp64, as grpo_mega.algorithms does (O(tokens) work).
        big = m.clone()
        _all_reduce(big, dist.ReduceOp.MAX, group)
        scale = torch.exp(m - big)  # an all-padding shard has m = -1e30, s = 0: scale 0
        sums = torch.stack([s * scale, scale * (a + s * (m - big)), zt])
        _all_reduce(sums, dist.ReduceOp.SUM, group)
        log_s = sums[0].log()
        logp = sums[2] - big - log_s
        ent = log_s - sums[1] / sums[0]
        row_stats = torch.stack([big + log_s, ent], dim=1).float().contiguous()
        ctx.save_for_backward(z, targets, row_stats)
        ctx.meta = (rows_per_b, sb, st, vocab_start, vocab_size, inv_temp, block)
        return logp.float(), ent.float()

    @staticmethod
    def backward(ctx, g_lp: Optional[Tensor], g_ent: Optional[Tensor]):
        z, targets, row_stats = ctx.saved_tensors
        rows_per_b, sb, st, vocab_start, vocab_size, inv_temp, block = ctx.meta
        n_rows, n_cols = targets.numel(), z.shape[-1]
        zeros = torch.zeros(n_rows, dtype=torch.float32, device=z.device)
        g_lp = zeros if g_lp is None else g_lp.reshape(-1).float().contiguous()
        g_ent = zeros if g_ent is None else g_ent.reshape(-1).float().contiguous()
        grad = torch.empty(n_rows, n_cols, dtype=z.dtype, device=z.device)
        if n_rows:
            _grad_kernel[(n_rows,)](z, targets, row_stats, g_lp, g_ent, grad, rows_per_b, sb, st,
                                    n_cols, vocab_start, vocab_size, inv_temp, BLOCK=block)
        return grad.view(z.shape), None, None, None, None, None, None


def fused_logprobs_entropy(logits_shard: Tensor, targets: Tensor, tp_group=None, *,
                           temperature: float = 1.0, vocab_size: Optional[int] = None,
                           block: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """log pi(y) and H(pi) of softmax(logits / temperature), vocab-parallel, fused.

    Args:
        logits_shard: [B, S, V/tp] or [N, V/tp], this rank's vocab slice, any float
            dtype (bf16 is read as is and computed in fp32). May be a slice such as
            ``logits[:, :-1]``: only the vocab dim must have unit stride.
        targets: [B, S] or [N] GLOBAL token ids.
        tp_group: tensor-parallel group, or None for a single rank.
        temperature: the sampling temperature (0 is treated as 1, as vLLM's greedy
            log-probs are of the unscaled logits).
        vocab_size: the real vocabulary; columns with global id >= vocab_size
            (megatron's padding) get probability 0. Default: all columns.
        block: vocab columns per kernel iteration, a power of two; default
            min(2048, V/tp rounded up).

    Returns:
        (logp, entropy), each [B, S] or [N], fp32; differentiable w.r.t. the logits.
    """
    _check_logits(logits_shard, "logits_shard")
    if not fused_available(logits_shard.device):
        raise RuntimeError(f"the fused log-prob kernel needs Triton and a CUDA tensor (got "
                           f"{logits_shard.device}, triton {'present' if triton else 'absent'}); "
                           f"use --algorithm.logprob_kernel=torch")
    if not isinstance(targets, Tensor) or targets.shape != logits_shard.shape[:-1]:
        raise ValueError(f"targets must have shape {tuple(logits_shard.shape[:-1])} "
                         f"(logits_shard.shape[:-1])")
    tp, rank = _tp_size_rank(tp_group)
    n_cols = logits_shard.shape[-1]
    vocab = n_cols * tp if vocab_size is None else int(vocab_size)
    if not 0 < vocab <= n_cols * tp:
        raise ValueError(f"vocab_size={vocab_size} must be in (0, {n_cols * tp}]")
    if targets.numel() and bool(((targets < 0) | (targets >= vocab)).any()):
        raise ValueError(f"targets contain ids outside the vocabulary [0, {vocab})")
    if block is not None and (block < 16 or block & (block - 1)):
        raise ValueError(f"block={block} must be a power of two >= 16")
    inv_temp = 1.0 / temperature if temperature not in (0.0, 1.0) else 1.0
    tgt = targets.reshape(-1).long().contiguous()
    logp, ent = _FusedLogprobEntropy.apply(logits_shard, tgt, tp_group, rank * n_cols, vocab,
                                           float(inv_temp), _block(n_cols, block))
    return logp.view(targets.shape), ent.view(targets.shape)
