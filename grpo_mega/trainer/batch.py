"""One ``TrainingBatch`` per step, and the two passes that consume it through the pipeline.

The batch is packed once, on the trainer's device, from this DP rank's rollout
samples and their advantages. Token alignment: a sequence is ``prompt + response``
and the logits at position ``t`` predict token ``t + 1``; the shift is done here
once (``targets = tokens[:, 1:]``) and every per-token tensor lives on that
shifted grid ``[N, S - 1]``: ``loss_mask[i, t]`` is True when ``tokens[i, t + 1]``
is a response token.

Mini-batches (PPO epochs / several optimizer steps) and micro-batches are row
slices of the same storage. A micro-batch is also trimmed to its own longest
sequence (rounded up to the FP8 multiple), so the work per micro-batch does not
grow with the longest sequence of the step. With ``parallel.packing`` (``packing``)
a micro-batch keeps its rows but the model runs them as one THD sequence with no
padding between them (``packed``, ``models.packing``); the loss still reads the
row grid, so both layouts train on the same tokens with the same normalisers. Reference / old log-probs computed on
the last pipeline stage are written straight into the batch's device tensors, and
update metrics stay on the device until ``update_policy`` returns.

MoE routing (``algorithm.routing_replay``) is the one per-token tensor on the unshifted
grid: ``routed_experts[i, t]`` holds the experts chosen *at* token ``t`` (the routing of
``tokens[i, t]``'s hidden state), for every layer. The old-policy pass records it
(``compute_logprobs(..., routing="record")``) and the update replays it
(``update_policy(..., replay_routing=True)``), micro-batch by micro-batch.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from grpo_mega import algorithms as A
from grpo_mega.algorithms.vocab_parallel_triton import fused_logprobs_entropy
from grpo_mega.distributed.schedule import run_microbatches
from grpo_mega.distributed.state import ParallelState
from grpo_mega.models import routing as R
from grpo_mega.models.head import trainable_logits
from grpo_mega.models.packing import PackedRows, pack_rows

_PER_TOKEN = ("targets", "loss_mask", "rollout_logp", "old_logp", "ref_logp")


@dataclass
class TrainingBatch:
    """Everything one step trains on, as device tensors (N rows, S padded tokens)."""

    tokens: Tensor            # [N, S] long, prompt + response, right-padded with pad_id
    targets: Tensor           # [N, S-1] long, tokens[:, 1:] (the next-token shift)
    loss_mask: Tensor         # [N, S-1] bool, True on response targets
    advantages: Tensor        # float32: [N] per sequence, or [N, S-1] per token (process supervision)
    rollout_logp: Tensor      # [N, S-1] float32, the engine's log-probs of the sampled tokens
    seq_lens: list[int]       # host copy of prompt + response lengths, to trim without a sync
    pad_multiple: int = 1     # FP8 GEMMs need token counts that are a multiple of 16
    old_logp: Optional[Tensor] = None  # [N, S-1] float32, filled by compute_logprobs
    ref_logp: Optional[Tensor] = None  # [N, S-1] float32, filled by compute_logprobs
    routed_experts: Optional[Tensor] = None  # [N, S, L, k] int16 expert ids (-1: not recorded), see above
    packing: bool = False     # run each micro-batch packed (THD, ``parallel.packing``)

    @classmethod
    def pack(cls, prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]],
             rollout_logp: Sequence[Sequence[float]], advantages: Sequence[float] | Tensor, *,
             pad_id: int, device: torch.device | str = "cpu", pad_to_multiple: int = 1,
             response_mask: Optional[Sequence[Sequence[int]]] = None,
             packing: bool = False) -> "TrainingBatch":
        """Pad every row to the step's longest sequence (rounded up to ``pad_to_multiple``)
        on the host, then move the batch to ``device`` once.

        ``response_mask`` (multi-turn episodes): per response token, 1 where the model
        sampled it, 0 where the environment's tokens were appended; the loss mask then
        leaves the 0 tokens out (their rollout log-probs are kept as given, 0.0).
        None or empty: every response token is the model's. ``packing``: the model passes
        run each micro-batch packed (``packed``).

        ``advantages``: [N] per sequence, or a [N, T] tensor per response token (T >= the
        longest response; row i's first len(response_ids[i]) columns are used), placed on
        the shifted grid like the loss mask: response token j of a row with a p-token
        prompt at column p - 1 + j; prompt and padding columns get 0."""
        lens = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids)]
        n = len(lens)
        s = -(-max(lens, default=1) // pad_to_multiple) * pad_to_multiple
        # One tensor per field from flat host lists (not a tensor per row: that Python loop
        # was most of the advantage stage).
        tokens = torch.tensor([[*p, *r] + [pad_id] * (s - len(p) - len(r))
                               for p, r in zip(prompt_ids, response_ids)], dtype=torch.long).reshape(n, s)
        first = torch.tensor([len(p) - 1 for p in prompt_ids], dtype=torch.long).reshape(n, 1)
        count = torch.tensor([len(r) for r in response_ids], dtype=torch.long).reshape(n, 1)
        col = torch.arange(s - 1).reshape(1, s - 1)
        mask = (col >= first) & (col < first + count)  # row-major: row i's response in order
        rlp = torch.zeros((n, s - 1), dtype=torch.float32)
        rlp[mask] = torch.tensor([x for lp in rollout_logp for x in lp],
                                 dtype=torch.float32)
        sampled = None
        if response_mask:
            if [len(m) for m in response_mask] != [len(r) for r in response_ids]:
                raise ValueError("response_mask must have one entry per response token of every row")
            sampled = torch.zeros((n, s - 1), dtype=torch.bool)
            sampled[mask] = torch.tensor([bool(x) for m in response_mask for x in m], dtype=torch.bool)
        adv = torch.as_tensor(advantages, dtype=torch.float32)
        per_token = adv.dim() == 2
        if per_token:
            longest = max((len(r) for r in response_ids), default=0)
            if adv.shape[0] != n or adv.shape[1] < longest:
                raise ValueError(f"per-token advantages have shape {tuple(adv.shape)}; need [{n}, >= {longest}] "
                                 "(rows, longest response)")
            adv_tok = torch.zeros((n, s - 1), dtype=torch.float32)
            adv_tok[mask] = adv[torch.arange(adv.shape[1]).reshape(1, -1) < count]
        adv = adv_tok if per_token else adv.reshape(n)
        if sampled is not None:
            mask = mask & sampled  # environment tokens are context, never trained on
        tokens = tokens.to(device)
        return cls(tokens=tokens, targets=tokens[:, 1:], loss_mask=mask.to(device),
                   advantages=adv.to(device), rollout_logp=rlp.to(device), seq_lens=lens,
                   pad_multiple=pad_to_multiple, packing=packing)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def save(self, path) -> None:
        """Write the batch as plain tensors (loads with ``weights_only=True``), for replaying
        one step's update at another layout (``logging.record_batches``)."""
        data = {k: v.detach().cpu() for k, v in dataclasses.asdict(self).items() if isinstance(v, Tensor)}
        data.update(seq_lens=torch.tensor(self.seq_lens), pad_multiple=torch.tensor(self.pad_multiple),
                    packing=torch.tensor(self.packing))
        torch.save(data, path)

    @classmethod
    def load(cls, path, device: torch.device | str = "cpu") -> "TrainingBatch":
        """A batch written by ``save``, on ``device`` (targets re-made as the shifted view)."""
        d = torch.load(path, weights_only=True, map_location="cpu")
        tokens = d["tokens"].to(device)
        opt = {k: d[k].to(device) for k in ("old_logp", "ref_logp", "routed_experts") if k in d}
        return cls(tokens=tokens, targets=tokens[:, 1:], loss_mask=d["loss_mask"].to(device),
                   advantages=d["advantages"].to(device), rollout_logp=d["rollout_logp"].to(device),
                   seq_lens=d["seq_lens"].tolist(), pad_multiple=int(d["pad_multiple"]),
                   packing=bool(d.get("packing", False)), **opt)

    @property
    def num_tokens(self) -> int:
        """Prompt + response tokens (unpadded), from the host copy."""
        return sum(self.seq_lens)

    @functools.cached_property
    def packed(self) -> Optional[PackedRows]:
        """This batch's rows as one THD sequence (``models.packing``), tail-padded to
        ``pad_multiple``; None without ``packing`` (the model runs the padded ``tokens``)."""
        return pack_rows(self.tokens, self.seq_lens, self.pad_multiple) if self.packing else None

    @property
    def computed_positions(self) -> int:
        """Positions a model pass computes for this batch: ``b * s`` padded, ``T`` packed."""
        if self.packing:
            return self.packed.total
        return self.tokens.numel()

    def empty_routing(self, num_layers: int, topk: int) -> Tensor:
        """A [N, S, L, k] int16 buffer of -1 on the batch's device, for recorded routing."""
        return R.empty_routing(len(self), self.tokens.shape[1], num_layers, topk, self.tokens.device)

    def empty_logp(self) -> Tensor:
        """A zeroed [N, S-1] float32 buffer on the batch's device, for old/ref log-probs."""
        return torch.zeros_like(self.rollout_logp)

    def slice(self, start: int, stop: int) -> "TrainingBatch":
        """Rows ``start:stop`` as views, columns trimmed to their own longest sequence."""
        lens = self.seq_lens[start:stop]
        s = -(-max(lens, default=1) // self.pad_multiple) * self.pad_multiple
        s = min(s, self.tokens.shape[1])
        rows = slice(start, stop)
        per_tok = {k: (None if getattr(self, k) is None else getattr(self, k)[rows, :s - 1])
                   for k in _PER_TOKEN}
        adv = self.advantages[rows] if self.advantages.dim() == 1 else self.advantages[rows, :s - 1]
        routed = None if self.routed_experts is None else self.routed_experts[rows, :s]
        return dataclasses.replace(self, tokens=self.tokens[rows, :s], advantages=adv,
                                   seq_lens=lens, routed_experts=routed, **per_tok)

    def split(self, size: int) -> list["TrainingBatch"]:
        """Consecutive slices of ``size`` rows (the last one may be shorter)."""
        return [self.slice(i, min(i + size, len(self))) for i in range(0, len(self), size)]


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
    loss, m = A.policy_loss(
        logp, old, mb.advantages, mb.loss_mask,
        clip_low=algo.clip_low, clip_high=algo.clip_high, dual_clip=algo.dual_clip,
        agg=algo.loss_agg, variant=algo.policy_loss,
        ref_logp=mb.ref_logp if algo.kl_coef > 0 and kl is None else None,
        kl_coef=algo.kl_coef, kl_kind=algo.kl_kind, kl=kl,
        rollout_logp=mb.rollout_logp if A.behaviour_logp_needed(algo.off_policy, algo.tis_cap) else None,
        tis_cap=algo.tis_cap, off_policy=algo.off_policy, entropy=entropy, max_len=max_len,
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
                     seq_tokens=n_valid.new_tensor(mb.num_tokens))
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
        metrics = {k: v / n for k, v in sums.items() if k not in ("loss", "rollout_gap_sum")}
        metrics["pad_frac"] = 1.0 - seq_tokens / positions.clamp(min=1.0)
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
