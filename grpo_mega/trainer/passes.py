"""The model passes over a step's ``TrainingBatch``, run through the pipeline schedule.

``compute_logprobs``: forward only, the reference's or the old policy's log-probs of each
micro-batch written into the batch (``ref_logp`` / ``old_logp``), optionally recording the
MoE routing. ``update_policy``: one optimizer step over a mini-batch's micro-batches, the
GRPO loss of each (``micro_loss``) normalised by the global (all DP ranks, all micro-batches)
token and sequence counts, so the gradient does not depend on how rows were cut into
micro-batches or packed. ``metrics_to_floats``: the step's one host sync of the metrics.

A step reads ``trainer.stages`` -> these passes -> ``distributed.schedule``; the data they
read and write is ``trainer.batch.TrainingBatch`` (built before, never rebuilt here).
The output layer runs only at the trainable positions (``models.head.trainable_logits``)
unless ``all_positions``; packed micro-batches (``parallel.packing``) run as one THD sequence
each (``models.packing``) and their logits come back in the row grid's order.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from grpo_mega import algorithms as A
from grpo_mega.algorithms.vocab_parallel_triton import fused_logprobs_entropy
from grpo_mega.distributed.schedule import run_microbatches
from grpo_mega.distributed.state import ParallelState
from grpo_mega.models import routing as R
from grpo_mega.models.head import trainable_logits
from grpo_mega.trainer.batch import TrainingBatch


def _logits_at(micro: list[TrainingBatch], all_positions: bool):
    """The schedule's ``logits_at``: the output layer at the trainable positions only
    (``models.head``), or None for every position (``all_positions``, the path before;
    refused for packed micro-batches, whose every-position logits are not the row grid)."""
    if all_positions and any(mb.packing for mb in micro):
        raise ValueError("all_positions=True scores the padded [b, s] grid; it cannot run packed "
                         "micro-batches (--parallel.packing=false)")
    return None if all_positions else (lambda model, mb: trainable_logits(model, mb.loss_mask, mb.packed))


def _scored_targets(logits: Tensor, mb: TrainingBatch, all_positions: bool) -> Tensor:
    """The targets of the positions ``logits`` holds: ``[b, s]`` for ``[b, s, V/tp]`` (the
    last position padded, see ``_with_last_target``), else ``[1, K]`` for the trainable
    positions' ``[1, K, V/tp]`` (``models.head.trainable_logits``)."""
    if all_positions:
        return _with_last_target(mb.targets)
    tgt = mb.targets[mb.loss_mask].unsqueeze(0)
    if logits.shape[:-1] != tgt.shape:
        raise ValueError(f"logits {tuple(logits.shape)} are not the [1, K={tgt.shape[1]}, V/tp] of the "
                         "micro-batch's trainable positions: run the model inside "
                         "models.head.trainable_logits, or pass all_positions=True")
    return tgt


def _to_grid(x: Tensor, mb: TrainingBatch, all_positions: bool) -> Tensor:
    """Per-position values of the scored positions -> ``[b, s-1]``: ``[b, s]`` rows lose the
    last position; ``[1, K]`` values go to the trainable positions, 0 elsewhere (with their
    gradient: ``masked_scatter`` routes it back to the packed values)."""
    if all_positions:
        return x[:, :-1]
    return x.new_zeros(mb.loss_mask.shape).masked_scatter(mb.loss_mask, x.reshape(-1))


def _with_last_target(tgt: Tensor) -> Tensor:
    """[b, s-1] targets -> [b, s], a 0 appended to each row. The logits at the last position
    predict nothing, but taking ``logits[:, :-1]`` of a [b, s, V/tp] shard (b > 1) is not a
    view the vocab-parallel functions can flatten: they would copy the whole shard. Scoring
    the last position too costs 1/s more work and no copy; its gradient is exactly 0."""
    return torch.nn.functional.pad(tgt, (0, 1))


def _sampling_kw(vocab_size: int, temperature: float, chunk_size: Optional[int]) -> dict:
    # vLLM's processed logprobs are of softmax(logits / T) over the real vocabulary; the
    # ratio must use the same distribution. Masking and T are applied chunk by chunk.
    return dict(vocab_size=vocab_size, temperature=temperature, chunk_size=chunk_size)


def _logprobs_entropy(logits: Tensor, mb: TrainingBatch, ps: ParallelState, *, vocab_size: int,
                      temperature: float, fused: bool, entropy: bool = True,
                      chunk_size: Optional[int] = None, all_positions: bool = False):
    """(logp, entropy or None), each [b, s-1] (0 where nothing was scored), of the sampling
    distribution, for the logits of ``mb``: ``[1, K, V_pad/tp]`` at its trainable positions,
    or ``[b, s, V_pad/tp]`` with ``all_positions``. ``fused``: the Triton kernel reads the
    bf16 shard directly; otherwise the vocab-parallel functions read it ``chunk_size``
    tokens at a time (None: all at once). Entropy is a metric here, so it carries no gradient."""
    tgt = _scored_targets(logits, mb, all_positions)
    if fused:
        logp, ent = fused_logprobs_entropy(logits, tgt, ps.tp_group,
                                           temperature=temperature, vocab_size=vocab_size)
        return _to_grid(logp, mb, all_positions), (_to_grid(ent.detach(), mb, all_positions)
                                                   if entropy else None)
    kw = _sampling_kw(vocab_size, temperature, chunk_size)
    logp = _to_grid(A.vocab_parallel_logprobs(logits, tgt, ps.tp_group, **kw), mb, all_positions)
    if not entropy:
        return logp, None
    with torch.no_grad():
        ent = A.vocab_parallel_entropy(logits.detach(), ps.tp_group, **kw)
    return logp, _to_grid(ent, mb, all_positions)


def compute_logprobs(model, micro: list[TrainingBatch], ps: ParallelState, *, vocab_size: int,
                     temperature: float, key: str, fused: bool = False,
                     chunk_size: Optional[int] = None, record_routing: bool = False,
                     all_positions: bool = False) -> None:
    """Forward-only pass; on the last stage writes each micro-batch's log-probs into its
    ``key`` tensor ("old_logp" / "ref_logp"), a view of the step's batch (allocate it
    with ``empty_logp`` before slicing), at the trainable positions (``loss_mask``; 0
    elsewhere). ``chunk_size``: tokens per block of the logits shard
    (``algorithm.logits_chunk_size``). ``record_routing``: every stage also writes its MoE
    layers' routing into ``mb.routed_experts`` (allocate with ``empty_routing``).
    ``all_positions``: run the output layer at every position, as before
    ``models.head`` (for comparisons: the same values, far more memory)."""

    def loss_fn(logits, mb: TrainingBatch):
        logp, _ = _logprobs_entropy(logits, mb, ps, vocab_size=vocab_size,
                                    temperature=temperature, fused=fused, entropy=False,
                                    chunk_size=chunk_size, all_positions=all_positions)
        getattr(mb, key).copy_(logp)
        return logits.new_zeros(()), {}

    around = (lambda mb: R.recording(model, mb.routed_experts, mb.packed)) if record_routing else None
    run_microbatches(model, micro, loss_fn, ps, forward_only=True, around_forward=around,
                     logits_at=_logits_at(micro, all_positions))


def micro_loss(logits: Tensor, mb: TrainingBatch, ps: ParallelState, algo, *,
               ref_logits: Optional[Tensor] = None, vocab_size: int, temperature: float,
               max_len: int, reuse_current_as_old: bool, global_tokens: int, global_seqs: int,
               fused: bool = False, chunk_size: Optional[int] = None,
               all_positions: bool = False) -> tuple[Tensor, dict, Tensor]:
    """The GRPO loss of one micro-batch from its logits shard ``logits: [1, K, V_pad/tp]`` at
    its K trainable positions (``models.head.trainable_logits``), or ``[b, s, V_pad/tp]``
    with ``all_positions`` (and ``ref_logits``, same shape, when ``algo.kl_kind`` needs
    them): its share of the mini-batch's loss over ``global_tokens`` / ``global_seqs``.
    Returns (loss, the metrics of ``policy_loss``, logp [b, s-1] of the sampling
    distribution, 0 where nothing was scored)."""
    logp, entropy = _logprobs_entropy(logits, mb, ps, vocab_size=vocab_size, temperature=temperature,
                                      fused=fused, chunk_size=chunk_size, all_positions=all_positions)
    kl = None
    if ref_logits is not None:
        # Same sampling distribution (padding mask, temperature) for both policies.
        kl = _to_grid(A.exact_kl(algo.kl_kind, logits, ref_logits, ps.tp_group,
                                 **_sampling_kw(vocab_size, temperature, chunk_size)), mb, all_positions)
    old = logp.detach() if reuse_current_as_old else mb.old_logp
    # The behaviour correction in force: with max_staleness >= 1 on by default (AReaL's mask).
    cap, mode = A.behaviour_correction(algo.off_policy, algo.tis_cap, algo.tis_mode, algo.max_staleness)
    loss, m = A.policy_loss(
        logp, old, mb.advantages, mb.loss_mask,
        clip_low=algo.clip_low, clip_high=algo.clip_high, dual_clip=algo.dual_clip,
        agg=algo.loss_agg, variant=algo.policy_loss,
        ref_logp=mb.ref_logp if algo.kl_coef > 0 and kl is None else None,
        kl_coef=algo.kl_coef, kl_kind=algo.kl_kind, kl=kl,
        rollout_logp=mb.rollout_logp if A.behaviour_logp_needed(algo.off_policy, cap) else None,
        tis_cap=cap, off_policy=algo.off_policy, tis_mode=mode, entropy=entropy, max_len=max_len,
        global_tokens=max(global_tokens, 1), global_seqs=max(global_seqs, 1))
    return loss, m, logp


def update_policy(model, optimizer, micro: list[TrainingBatch], ps: ParallelState, algo, *,
                  vocab_size: int, temperature: float, max_len: int,
                  reuse_current_as_old: bool, fused: bool = False,
                  reference=None, chunk_size: Optional[int] = None,
                  replay_routing: bool = False, all_positions: bool = False) -> dict[str, Tensor | float]:
    """One optimizer step over ``micro`` (this DP rank's share of a mini-batch).

    The loss of each micro-batch is its share of the global mini-batch mean
    (``A.global_batch_counts`` over DP), so gradients are summed over micro-batches
    and DP ranks. ``reuse_current_as_old``: the proximal (old) log-probs equal the current
    ones at update time, so no extra forward was run (``A.proximal_pass_needed`` is False:
    one PPO epoch and mini-batch, no TIS, no staleness; or ``algorithm.off_policy:
    behaviour``, which anchors on the rollout's log-probs instead). Returns the
    metrics over all DP replicas' rows as 0-d float64 device tensors (``grad_norm`` / ``skipped`` as floats from
    the optimizer); ``metrics_to_floats`` turns them into numbers once per step.

    ``reference``: the frozen reference model, needed when ``algo.kl_kind`` is computed
    from logits (``full``): the schedule runs it on each micro-batch inside the policy's
    forward step (at PP>1 its hidden states travel with the policy's) and the loss takes
    the exact KL of the two logits shards.

    ``chunk_size``: tokens per block of the logits shard in the log-prob, entropy and KL
    functions (``algorithm.logits_chunk_size``; None: the whole shard at once). The padding
    mask, the fp32 upcast and the temperature are applied per block, so no full-shard
    copy is made; results do not depend on it.

    ``replay_routing``: the policy's MoE routers take each micro-batch's
    ``mb.routed_experts`` instead of their own top-k (the reference routes itself).

    The output layer of the policy (and of the reference) runs only at the positions whose
    next token is trainable (``models.head``): logits and their gradient are ``[K, V/tp]``
    per micro-batch, K its trainable tokens, whatever the prompt or tool-output length.
    ``all_positions``: every position, as before (for comparisons).
    """
    tokens, seqs = A.global_batch_counts([mb.loss_mask for mb in micro], ps.dp_group if ps.dp > 1 else None)
    exact = algo.kl_coef > 0 and A.kl_needs_logits(algo.kl_kind)
    if exact and reference is None:
        raise ValueError(f"algorithm.kl_kind={algo.kl_kind!r} needs the reference model: pass "
                         "update_policy(..., reference=ref)")

    def loss_fn(logits, mb: TrainingBatch, ref_logits: Optional[Tensor] = None):
        loss, m, logp = micro_loss(logits, mb, ps, algo, ref_logits=ref_logits if exact else None,
                                   vocab_size=vocab_size, temperature=temperature, max_len=max_len,
                                   reuse_current_as_old=reuse_current_as_old, global_tokens=tokens,
                                   global_seqs=seqs, fused=fused, chunk_size=chunk_size,
                                   all_positions=all_positions)
        # float64 on the device: the same sums the host used to do in Python floats.
        n_valid = mb.loss_mask.sum().double()
        gap = ((logp.detach() - mb.rollout_logp).abs() * mb.loss_mask).sum().double()
        stats = {k: torch.as_tensor(v, device=n_valid.device).detach().double() * n_valid
                 for k, v in m.items() if k not in ("pg_loss", "kl_loss")}
        stats.update(loss=loss.detach().double(), n_tokens=n_valid, rollout_gap_sum=gap,
                     positions=n_valid.new_tensor(mb.computed_positions),
                     seq_tokens=n_valid.new_tensor(mb.num_tokens), micro_batches=n_valid.new_tensor(1.0))
        return loss, stats

    optimizer.zero_grad()
    around = (lambda mb: R.replaying(model, mb.routed_experts, mb.packed)) if replay_routing else None
    outs = run_microbatches(model, micro, loss_fn, ps, forward_only=False,
                            reference=reference if exact else None, around_forward=around,
                            logits_at=_logits_at(micro, all_positions))
    info = optimizer.step()
    sums: dict[str, Tensor] = {}
    for o in outs:
        for k, v in o.items():
            sums[k] = sums[k] + v if k in sums else v
    metrics: dict[str, Tensor | float] = {"loss": 0.0, "rollout_logp_gap": 0.0}  # not the last stage
    if sums and ps.dp > 1:
        # Each replica summed its own rows: the step's metrics are over all replicas' rows.
        keys = sorted(sums)
        flat = torch.stack([sums[k].reshape(()) for k in keys])
        dist.all_reduce(flat, group=ps.dp_group)
        sums = dict(zip(keys, flat.unbind()))
    if sums:
        n = sums.pop("n_tokens").clamp(min=1.0)
        # share of the positions the passes computed that were padding (parallel.packing)
        positions, seq_tokens = sums.pop("positions"), sums.pop("seq_tokens")
        micro_batches = sums.pop("micro_batches")
        metrics = {k: v / n for k, v in sums.items() if k not in ("loss", "rollout_gap_sum")}
        metrics["pad_frac"] = 1.0 - seq_tokens / positions.clamp(min=1.0)
        # over every replica's micro-batches (fillers count as micro-batches of 0 tokens)
        metrics["tokens_per_micro_batch"] = seq_tokens / micro_batches.clamp(min=1.0)
        metrics["loss"] = sums["loss"]
        metrics["rollout_logp_gap"] = sums["rollout_gap_sum"] / n
    metrics.update(grad_norm=info["grad_norm"], skipped=float(info["skipped"]))
    return metrics


def metrics_to_floats(metrics: dict[str, Tensor | float]) -> dict[str, float]:
    """Device metrics -> Python floats with one host sync (one stacked copy)."""
    keys = [k for k, v in metrics.items() if isinstance(v, Tensor)]
    values = torch.stack([metrics[k].reshape(()).double() for k in keys]).tolist() if keys else []
    on_device = dict(zip(keys, values))
    return {k: on_device[k] if k in on_device else float(v) for k, v in metrics.items()}
