"""Shared data and float64 references for the algorithms tests (independent of the code
under test, except ``split_loss``, which drives ``policy_loss`` over micro-batches).

Tolerance "1e-6" (``FP32``) for fp32 inputs means |ours - fp64| <= 1e-6 + 1e-6 |fp64|:
an fp32 result of magnitude ~10 cannot be closer than its own rounding.
"""
from __future__ import annotations

import torch

from grpo_mega.algorithms import AGGREGATIONS, global_batch_counts, policy_loss

V = 96          # divisible by 1, 2 and 4
B, L = 4, 6     # logits [B, L, V/tp]: a 2-D leading shape on purpose
LENGTHS = [6, 4, 0, 5]  # ragged, with an empty response
FP32 = dict(atol=1e-6, rtol=1e-6)
LOSS_KW = dict(clip_low=0.2, clip_high=0.28, dual_clip=1.5, kl_coef=0.1, kl_kind="k3", tis_cap=1.2)
MODES = sorted(AGGREGATIONS)
MAX_LEN = 8


def case(seed: int = 0) -> dict:
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


def ref_agg(tok, mask, mode, max_len=None):
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


def ref_loss(logp, old, adv, mask, ref, rollout, *, clip_low, clip_high, dual_clip, kl_coef,
              kl_kind, tis_cap, mode="token-mean", max_len=None, kl_full=None):
    """GRPO loss written as the objective to maximise, negated; all float64. kl_kind "k3"
    uses ``ref`` (reference log-probs of the targets); "full" uses ``kl_full`` [B, T], the
    exact KL(pi || pi_ref) over the vocabulary computed by the caller."""
    assert kl_kind in ("k3", "full")
    adv = adv[:, None].expand_as(logp) if adv.dim() == 1 else adv
    ratio = torch.exp(logp - old)
    surr = torch.minimum(ratio * adv, ratio.clamp(1 - clip_low, 1 + clip_high) * adv)
    if dual_clip is not None:
        surr = torch.where(adv < 0, torch.maximum(surr, dual_clip * adv), surr)
    if rollout is not None:
        surr = surr * torch.exp(old - rollout).clamp(max=tis_cap)
    if kl_kind == "full":
        tok = -surr + kl_coef * kl_full
    else:
        d = ref - logp
        tok = -surr + kl_coef * (torch.exp(d) - d - 1)
    return ref_agg(tok, mask, mode, max_len)


def split_loss(logp_full, c, mode, row_slices, dp_group):
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


def batch_case(seed=1, rows=8, cols=7):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 3, 0, 5, 1, 7, 2, 4])[:rows]
    mask = torch.arange(cols)[None, :] < lengths[:, None]
    logp = -torch.rand(rows, cols, generator=g) * 3
    return dict(logp=logp, old_logp=logp + 0.3 * torch.randn(rows, cols, generator=g),
                ref_logp=logp + 0.2 * torch.randn(rows, cols, generator=g),
                rollout_logp=logp + 0.2 * torch.randn(rows, cols, generator=g),
                advantages=torch.randn(rows, generator=g), mask=mask)
