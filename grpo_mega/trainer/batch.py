"""One ``TrainingBatch`` per step: the data the passes train on, built, packed and sliced here.

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
row grid, so both layouts train on the same tokens with the same normalisers.

The passes that consume the batch (reference / old log-probs, the policy update) live
in ``trainer.passes``; the log-probs they compute on the last pipeline stage are written
straight into this batch's device tensors.

MoE routing (``algorithm.routing_replay``) is the one per-token tensor on the unshifted
grid: ``routed_experts[i, t]`` holds the experts chosen *at* token ``t`` (the routing of
``tokens[i, t]``'s hidden state), for every layer. The old-policy pass records it and the
update replays it (``trainer.passes``), micro-batch by micro-batch.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

from grpo_mega.models import routing as R
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
    filler: bool = False      # a micro-batch with nothing to train, run to keep DP in step (``trainer.microbatches``)

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
        """Prompt + response tokens (unpadded), from the host copy; 0 for a filler."""
        return 0 if self.filler else sum(self.seq_lens)

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

    def take(self, rows: Sequence[int]) -> "TrainingBatch":
        """The rows ``rows`` (indices, in that order) as a new batch (copies, same columns)."""
        idx = torch.tensor(list(rows), dtype=torch.long, device=self.tokens.device)
        per_row = {k: None if getattr(self, k) is None else getattr(self, k).index_select(0, idx)
                   for k in ("tokens", "loss_mask", "advantages", "rollout_logp", "old_logp", "ref_logp",
                             "routed_experts")}
        return dataclasses.replace(self, targets=per_row["tokens"][:, 1:],
                                   seq_lens=[self.seq_lens[i] for i in rows], **per_row)

    def split(self, size: int) -> list["TrainingBatch"]:
        """Consecutive slices of ``size`` rows (the last one may be shorter)."""
        return [self.slice(i, min(i + size, len(self))) for i in range(0, len(self), size)]
