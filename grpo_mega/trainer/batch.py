"""From rollout samples to per-token log-probs and the GRPO update, through the pipeline.

Token alignment: a sequence is ``prompt + response``; the logits at position
``t`` predict token ``t + 1``. All per-token tensors here live on the shifted
grid ``[b, s - 1]`` ("targets"): ``mask[:, t]`` is True when ``tokens[:, t + 1]``
is a response token.

Micro-batches are padded only to their own longest sequence, and are built once
per step so the forward-only passes (old / reference log-probs) and the update
see the same grouping. Everything on the last stage stays there: log-probs,
advantages and the loss never leave it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from grpo_mega import algorithms as A
from grpo_mega.algorithms.vocab_parallel_triton import fused_logprobs_entropy
from grpo_mega.models import mask_vocab_padding
from grpo_mega.distributed.state import ParallelState
from grpo_mega.distributed.schedule import run_microbatches


@dataclass
class Sample:
    """One prompt + response, with what the step computes for it."""

    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logp: list[float]
    reward: float = 0.0
    advantage: float = 0.0


def make_micro_batches(samples: list[Sample], micro_batch_size: int, pad_id: int,
                       pad_to_multiple: int = 1) -> list[dict]:
    """Split samples (in order) into micro-batches, each padded to its own longest
    (rounded up to ``pad_to_multiple``: FP8 GEMMs need a multiple of 16 tokens).

    Each dict: ``tokens [b, s]``, ``mask [b, s-1]`` (bool), ``advantages [b]``,
    ``rollout_logp [b, s-1]``.
    """
    out = []
    for i in range(0, len(samples), micro_batch_size):
        chunk = samples[i:i + micro_batch_size]
        s = max(len(x.prompt_ids) + len(x.response_ids) for x in chunk)
        s = -(-s // pad_to_multiple) * pad_to_multiple
        tokens = torch.full((len(chunk), s), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), s - 1), dtype=torch.bool)
        rlp = torch.zeros((len(chunk), s - 1), dtype=torch.float32)
        for j, x in enumerate(chunk):
            p, r = len(x.prompt_ids), len(x.response_ids)
            tokens[j, :p + r] = torch.tensor(x.prompt_ids + x.response_ids)
            mask[j, p - 1:p - 1 + r] = True
            if r:
                rlp[j, p - 1:p - 1 + r] = torch.tensor(x.rollout_logp, dtype=torch.float32)
        out.append({"tokens": tokens, "mask": mask, "rollout_logp": rlp,
                    "advantages": torch.tensor([x.advantage for x in chunk], dtype=torch.float32)})
    return out


def _target_logits(logits: torch.Tensor, vocab_size: int, ps: ParallelState,
                   temperature: float) -> torch.Tensor:
    """[b, s, V_pad/tp] -> fp32 [b, s-1, V_pad/tp] of the sampling distribution."""
    z = mask_vocab_padding(logits[:, :-1], vocab_size, ps.tp_rank).float()
    # vLLM's processed logprobs are of softmax(logits / T); the ratio must use the same.
    return z / temperature if temperature not in (0.0, 1.0) else z


def _logprobs_entropy(logits: torch.Tensor, tgt: torch.Tensor, ps: ParallelState, *,
                      vocab_size: int, temperature: float, fused: bool, entropy: bool = True):
    """(logp, entropy or None), each [b, s-1], of the sampling distribution. ``fused``: the
    Triton kernel reads the bf16 shard directly; otherwise the shard is masked, upcast and
    scaled first. Entropy is a metric here, so it carries no gradient."""
    if fused:
        logp, ent = fused_logprobs_entropy(logits[:, :-1], tgt, ps.tp_group,
                                           temperature=temperature, vocab_size=vocab_size)
        return logp, ent.detach() if entropy else None
    z = _target_logits(logits, vocab_size, ps, temperature)
    logp = A.vocab_parallel_logprobs(z, tgt, ps.tp_group)
    if not entropy:
        return logp, None
    with torch.no_grad():
        return logp, A.vocab_parallel_entropy(z.detach(), ps.tp_group)


def compute_logprobs(model, micro: list[dict], ps: ParallelState, *, vocab_size: int,
                     temperature: float, key: str, fused: bool = False) -> None:
    """Forward-only pass; stores ``mb[key]: [b, s-1]`` on the last stage."""

    def loss_fn(logits, mb):
        tgt = mb["tokens"][:, 1:].to(logits.device)
        logp, _ = _logprobs_entropy(logits, tgt, ps, vocab_size=vocab_size,
                                    temperature=temperature, fused=fused, entropy=False)
        return logits.new_zeros(()), {key: logp.cpu()}

    outs = run_microbatches(model, micro, loss_fn, ps, forward_only=True)
    for mb, o in zip(micro, outs):
        mb.update(o)


def update_policy(model, optimizer, micro: list[dict], ps: ParallelState, algo, *,
                  vocab_size: int, temperature: float, max_len: int,
                  reuse_current_as_old: bool, fused: bool = False) -> dict:
    """One optimizer step over ``micro`` (this DP rank's share of a mini-batch).

    The loss of each micro-batch is its share of the global mini-batch mean
    (``A.global_batch_counts`` over DP), so gradients are summed over
    micro-batches and DP ranks. ``reuse_current_as_old``: with one PPO epoch and
    no TIS, old log-probs equal the current ones, so no extra forward was run.
    """
    tokens, seqs = A.global_batch_counts([mb["mask"] for mb in micro], ps.dp_group if ps.dp > 1 else None)
    sums: dict[str, float] = {}

    def loss_fn(logits, mb):
        dev = logits.device
        tgt = mb["tokens"][:, 1:].to(dev)
        logp, entropy = _logprobs_entropy(logits, tgt, ps, vocab_size=vocab_size,
                                          temperature=temperature, fused=fused)
        old = logp.detach() if reuse_current_as_old else mb["old_logp"].to(dev)
        loss, m = A.policy_loss(
            logp, old, mb["advantages"].to(dev), mb["mask"].to(dev),
            clip_low=algo.clip_low, clip_high=algo.clip_high, dual_clip=algo.dual_clip,
            agg=algo.loss_agg, ref_logp=mb["ref_logp"].to(dev) if algo.kl_coef > 0 else None,
            kl_coef=algo.kl_coef, kl_kind=algo.kl_kind,
            rollout_logp=mb["rollout_logp"].to(dev) if algo.tis_cap else None,
            tis_cap=algo.tis_cap, entropy=entropy, max_len=max_len,
            global_tokens=max(tokens, 1), global_seqs=max(seqs, 1))
        n_valid = float(mb["mask"].sum())
        gap = ((logp.detach() - mb["rollout_logp"].to(dev)).abs() * mb["mask"].to(dev)).sum()
        stats = {k: float(v) * n_valid for k, v in m.items() if k not in ("pg_loss", "kl_loss")}
        stats.update(loss=float(loss.detach()), n_tokens=n_valid, rollout_gap_sum=float(gap))
        return loss, stats

    optimizer.zero_grad()
    outs = run_microbatches(model, micro, loss_fn, ps, forward_only=False)
    info = optimizer.step()
    for o in outs:
        for k, v in o.items():
            sums[k] = sums.get(k, 0.0) + v
    n = max(sums.pop("n_tokens", 0.0), 1.0)
    metrics = {k: v / n for k, v in sums.items() if k not in ("loss", "rollout_gap_sum")}
    metrics["loss"] = sums.get("loss", 0.0)
    metrics["rollout_logp_gap"] = sums.get("rollout_gap_sum", 0.0) / n
    metrics.update(grad_norm=info["grad_norm"], skipped=float(info["skipped"]))
    return metrics
