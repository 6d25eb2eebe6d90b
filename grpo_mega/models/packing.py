"""Packed (THD) micro-batches: a micro-batch's rows run as one sequence, with no padding between them.

Why: RL batches have long-tailed lengths. Padded, a micro-batch of rows ``[b, s]`` computes
``b * s`` positions for ``sum(len_i)`` real tokens; packed, it computes ``sum(len_i)`` plus at
most ``multiple - 1`` tail positions (``parallel.packing``).

Layout (``PackedRows``): row 0's tokens, row 1's, ..., then a tail of padding up to the
multiple the layout needs (FP8 GEMMs: 16; sequence parallelism: tp; ``precision.seq_multiple``),
as ``tokens: [1, T]``. megatron's ``PackedSeqParams`` (``qkv_format="thd"``) carries the
boundaries ``cu_seqlens = [0, len_0, len_0 + len_1, ..., T]``; the tail is a segment of its
own, so it attends only to itself and no real token ever sees it.

What keeps it the same model as the padded path:

* attention never crosses a boundary: Transformer Engine's THD attention reads ``cu_seqlens``
  on GPU; the local spec (CPU, or no TE) gets ``PackedDotProductAttention``, which runs
  megatron's own local attention on the segments with the usual causal mask, the segments
  of one length batched in one call (the boundaries as host ints and one mask of the longest
  segment are made once per micro-batch in ``pack_rows``, so no layer reads ``cu_seqlens``
  back from the device). Chosen over a document-masked SDPA / flex attention over the whole
  pack because it is the *same* math as the padded local path (same scaling, fp32 softmax,
  mask fill), so fp64 results agree to rounding, and it costs ``sum(len_i^2)`` instead of
  ``T^2``; one call per distinct length rather than per segment, because a call per segment
  (64 short rows in a demo micro-batch) made the demo's step 2.3x the padded one;
* RoPE positions restart per segment: with THD, megatron's attention rotates each segment
  by ``freqs[:len_i]`` (``rope_utils._apply_rotary_pos_emb_thd``, 0.16.1 and 0.19.2; with the
  local spec in one call per pack, ``_rope_thd_in_one_call``), given
  ``max_seqlen`` = the longest *segment*. A ``max_seqlen`` equal to the pack's length ``T``
  would switch megatron to its "packed freqs" case and rotate by the position *in the pack*
  (no restart), so ``max_seqlen`` is exact here, never an upper bound. ``position_ids``
  restart too (megatron's RoPE ignores them; a learned position embedding would read them);
* the loss is unchanged: logits are taken at the same trainable positions, in the same
  row-major order (``trainable_rows_packed``), so every per-token tensor of the loss keeps
  its ``[b, s-1]`` row grid and the normalisers (token-mean, seq-mean, Dr. GRPO, over the
  global batch) count exactly the tokens they count padded.

Context parallelism is not used by this project (``ParallelState`` has no CP axis); THD
under CP would need each segment padded to ``2 * cp`` (``cu_seqlens_q_padded``).
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

__all__ = ["PackedRows", "pack_rows", "trainable_rows_packed", "packed_core_attention",
           "use_packed_core_attention"]


@dataclass(frozen=True)
class PackedRows:
    """One micro-batch as a single THD sequence (see the module docstring).

    ``rows``/``cols``: ``[total]`` long, the ``[b, s]`` grid position of each packed real token,
    in packed order (the tail excluded), to move per-token values between the two layouts."""

    tokens: Tensor         # [1, T] long: the rows' tokens back to back, then the tail (token 0)
    position_ids: Tensor   # [1, T] long: 0..len_i-1 per row, 0..pad-1 on the tail
    starts: Tensor         # [b] long: where row i starts in the pack
    rows: Tensor           # [total] long: grid row of each packed real token
    cols: Tensor           # [total] long: grid column of each packed real token
    params: object         # megatron PackedSeqParams: cu_seqlens int32 [b + 1 (+1 tail)], max_seqlen
    pad: int               # tail positions (0 when sum(len_i) is already a multiple)

    @property
    def total(self) -> int:
        """Computed positions ``T`` (real tokens + tail)."""
        return self.tokens.shape[1]


def _segments(seq_lens: Sequence[int], multiple: int) -> tuple[list[int], int]:
    """Segment lengths of the pack (the rows, then the tail if any) and the tail length."""
    total = sum(seq_lens)
    pad = -(-max(total, 1) // multiple) * multiple - total
    return [*seq_lens, pad] if pad else list(seq_lens), pad


@functools.lru_cache(maxsize=None)
def _packed_params_class():
    """megatron's ``PackedSeqParams`` plus what the local packed attention needs, made once
    per micro-batch instead of once per layer: the boundaries as a host tuple (reading
    ``cu_seqlens`` back from the GPU in every layer was a device sync per layer) and one causal
    mask of the longest segment (every segment's mask is its top-left corner). TE's attention
    reads only the parent's fields."""
    from dataclasses import dataclass as _dataclass

    from megatron.core.packed_seq_params import PackedSeqParams

    @_dataclass
    class PackedParams(PackedSeqParams):
        host_cu_seqlens: tuple = ()   # cu_seqlens_q as Python ints
        causal: Tensor = None         # [1, 1, max_seqlen, max_seqlen] bool, True = masked

    return PackedParams


def pack_rows(tokens: Tensor, seq_lens: Sequence[int], multiple: int = 1) -> PackedRows:
    """``tokens: [b, s]`` right-padded rows with host lengths ``seq_lens`` (each >= 1) -> the
    packed layout, padded at the tail to a multiple of ``multiple``. Index arithmetic runs on
    the host lists, so nothing syncs with the device."""
    from grpo_mega.distributed.schedule import causal_mask

    b, s = tokens.shape
    if len(seq_lens) != b or any(n < 1 or n > s for n in seq_lens):
        raise ValueError(f"seq_lens {list(seq_lens)} do not fit tokens of shape {tuple(tokens.shape)} "
                         "(one length in 1..s per row)")
    segs, pad = _segments(seq_lens, multiple)
    lens = torch.tensor(seq_lens, dtype=torch.long)
    starts = torch.cumsum(lens, 0) - lens
    rows = torch.repeat_interleave(torch.arange(b), lens)
    cols = torch.arange(int(lens.sum())) - torch.repeat_interleave(starts, lens)
    dev = tokens.device
    rows, cols = rows.to(dev), cols.to(dev)
    flat = tokens[rows, cols]
    packed = torch.cat([flat, flat.new_zeros(pad)]).unsqueeze(0)
    pos = torch.cat([cols, torch.arange(pad, device=dev)]).unsqueeze(0)
    bounds = (0, *itertools.accumulate(segs))
    cu = torch.tensor(bounds, dtype=torch.int32, device=dev)
    longest = max(segs)  # the longest segment, never T itself: see the module docstring
    params = _packed_params_class()(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                    max_seqlen_q=longest, max_seqlen_kv=longest,
                                    host_cu_seqlens=bounds, causal=causal_mask(longest, dev))
    return PackedRows(tokens=packed, position_ids=pos, starts=starts.to(dev), rows=rows, cols=cols,
                      params=params, pad=pad)


def trainable_rows_packed(loss_mask: Tensor, starts: Tensor) -> Tensor:
    """``loss_mask: [b, s-1]`` bool, ``starts: [b]`` -> ``[K]`` long: the packed positions
    (rows of the ``[T, 1, h]`` hidden states) whose logits predict a trainable token, in the
    mask's row-major order: the same order as ``models.head.trainable_rows`` of the padded
    layout, so the loss sees the same ``[1, K, V/tp]`` logits either way."""
    seq, pos = loss_mask.nonzero(as_tuple=True)
    return starts[seq] + pos


@functools.lru_cache(maxsize=None)
def packed_core_attention():
    """The ``PackedDotProductAttention`` class (made on first use: megatron is imported lazily)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from grpo_mega.distributed.schedule import causal_mask

    class PackedDotProductAttention(DotProductAttention):
        """megatron's local ``DotProductAttention``, also for THD input (``packed_seq_params``):
        each segment of ``cu_seqlens`` runs alone through the parent's forward with a causal
        mask, so no query ever sees a key of another segment. Without ``packed_seq_params`` it
        is the parent, unchanged (same parameters: none; same checkpoint keys)."""

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None, **kwargs):
            if packed_seq_params is None:
                return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                       attention_bias=attention_bias, **kwargs)
            # THD: query [t, np, hn], key/value [t, ng, hn]; the output [t, 1, np * hn] is what
            # megatron's Attention reshapes the THD result to anyway.
            # Boundaries and mask were made once per micro-batch (pack_rows), not per layer.
            cu = getattr(packed_seq_params, "host_cu_seqlens", None) or packed_seq_params.cu_seqlens_q.tolist()
            full = getattr(packed_seq_params, "causal", None)
            if full is None:
                full = causal_mask(packed_seq_params.max_seqlen_q, query.device)
            # Segments of one length run as one batch [len, n, ...] (the padded path's batched
            # math, per row): one parent call per distinct length, not per segment. A demo
            # micro-batch holds 64 rows of a few lengths; a call per row made its update 3.7x
            # the padded one (benchmarks page, "per-step fixed cost").
            groups, inverse = _length_groups(packed_seq_params, cu, query.device)
            outs = []
            for n, idx in groups:  # idx: [len, rows] positions in the pack
                q, k, v = (x[idx] for x in (query, key, value))
                outs.append(super().forward(q, k, v, full[..., :n, :n], attn_mask_type=attn_mask_type,
                                            attention_bias=attention_bias, **kwargs).transpose(0, 1).flatten(0, 1))
            out = torch.cat(outs, dim=0).index_select(0, inverse)  # back to pack order
            return out.unsqueeze(1)

    return PackedDotProductAttention


def _length_groups(params, cu: Sequence[int], device) -> tuple[list[tuple[int, Tensor]], Tensor]:
    """(per distinct segment length n: ``[n, rows]`` long pack positions of those segments,
    column j the j-th such segment; ``inverse``: ``[T]`` long, where each pack position lands
    in the concatenation of the groups' row-major ``[rows * n]`` outputs). Made once per
    micro-batch and kept on ``params`` (every layer and the backward reuse it)."""
    cached = getattr(params, "_length_groups", None)
    if cached is not None:
        return cached
    by_len: dict[int, list[int]] = {}
    for a, b in zip(cu[:-1], cu[1:]):
        by_len.setdefault(b - a, []).append(a)
    groups, order = [], []
    for n, starts in by_len.items():
        idx = torch.tensor(starts).unsqueeze(0) + torch.arange(n).unsqueeze(1)  # [n, rows]
        groups.append((n, idx.to(device)))
        order.append(idx.t().reshape(-1))
    inverse = torch.argsort(torch.cat(order)).to(device)
    try:
        params._length_groups = (groups, inverse)
    except AttributeError:  # a plain PackedSeqParams with slots: recompute per layer
        pass
    return groups, inverse


def _rope_thd_in_one_call(original):
    """megatron's unfused THD RoPE (``rope_utils._apply_rotary_pos_emb_thd``) with positions
    restarting per segment, as one ``_apply_rotary_pos_emb_bshd`` call over the pack (each
    token's frequencies gathered at its position in its segment) instead of one call per
    segment: the same elementwise math per token, so the same bits, without a loop of b
    iterations per layer and pass (with 64 short rows a micro-batch, that loop was a third of
    the demo's packed update). Context parallelism, and freqs given per pack position
    (megatron's "packed freqs" case), go to ``original``."""
    from megatron.core.models.common.embeddings import rope_utils

    def apply(t, cu_seqlens, freqs, rotary_interleaved=False, mla_rotary_interleaved=False, mscale=1.0,
              cp_group=None, multi_latent_attention=None):
        bounds = cu_seqlens.tolist()  # one read, as megatron's loop does
        if (cp_group is None or cp_group.size() != 1 or multi_latent_attention is not None
                or (freqs.dim() >= 1 and freqs.size(0) == bounds[-1])):
            return original(t, cu_seqlens, freqs, rotary_interleaved=rotary_interleaved,
                            mla_rotary_interleaved=mla_rotary_interleaved, mscale=mscale, cp_group=cp_group,
                            multi_latent_attention=multi_latent_attention)
        lens = torch.tensor([b - a for a, b in zip(bounds[:-1], bounds[1:])])
        pos = torch.arange(bounds[-1]) - torch.repeat_interleave(torch.tensor(bounds[:-1]), lens)
        return rope_utils._apply_rotary_pos_emb_bshd(
            t.unsqueeze(1), freqs[pos.to(freqs.device)], rotary_interleaved=rotary_interleaved,
            mla_rotary_interleaved=mla_rotary_interleaved, mscale=mscale).squeeze(1)

    apply.grpo_mega_one_call = True
    return apply


def use_packed_core_attention(spec) -> None:
    """Put ``PackedDotProductAttention`` into a local layer spec's self-attention, in place,
    and megatron's unfused THD RoPE in one call per pack (``_rope_thd_in_one_call``)."""
    from megatron.core.models.common.embeddings import rope_utils

    attn = spec.submodules.self_attention.submodules
    attn.core_attention = packed_core_attention()
    if not getattr(rope_utils._apply_rotary_pos_emb_thd, "grpo_mega_one_call", False):
        rope_utils._apply_rotary_pos_emb_thd = _rope_thd_in_one_call(rope_utils._apply_rotary_pos_emb_thd)
