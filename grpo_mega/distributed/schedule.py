"""Forward/backward of a list of micro-batches through megatron's pipeline schedule.

``run_microbatches(model, micro_batches, loss_fn, ps, forward_only=...)`` hides
the ``forward_step_func -> (output, partial(loss_func))`` contract of
``get_forward_backward_func``: every stage iterates over the same micro-batches
(stage 0 embeds the tokens, the last stage computes the loss on vocab-parallel
logits), and the per-micro-batch outputs of ``loss_fn`` come back on the last
stage in order.

Micro-batches may differ in sequence length (each is padded only to its own
longest sample), so the schedule communicates shapes between stages. A micro-batch
is any object with a ``tokens: [b, s]`` attribute (the trainer's ``TrainingBatch``
slices) or a dict with a ``"tokens"`` key (tests, benchmarks). A micro-batch whose
``packed`` attribute is not None (``parallel.packing``, ``models.packing.PackedRows``) runs
as one THD sequence ``[1, T]`` instead, with its ``PackedSeqParams``.

    loss_fn(logits_shard: [b, s, V_pad/tp], mb) -> (loss: 0-d, outputs: dict)

With ``reference=`` (a frozen model with the policy's layout), the forward step also
runs the reference on the same micro-batch's tokens, without grad, and the loss gets
its logits shard: ``loss_fn(logits_shard, mb, ref_logits_shard)``. The reference shard
lives from that forward step to the micro-batch's backward, so one shard per stage
is alive at a time, never ``[B, T, V/tp]`` for the whole batch (the exact ``full``
KL needs it per token). At PP>1 the reference's hidden states travel between stages
next to the policy's, in one activation of twice the batch (``_WithReference``): the
policy's rows first, the reference's after them. The reference half carries no graph,
so its share of the gradient sent back is zero and never reaches either model.

``around_forward(mb)``, when given, returns a context manager entered around the policy's
forward of that micro-batch on every stage (not the reference's): MoE routing replay
records or forces each stage's routing there (``grpo_mega.models.routing``).

``logits_at(model, mb)``, when given, returns a context manager entered around every forward
of ``mb``, the policy's and the reference's, on every stage: the trainer's
``models.head.trainable_logits`` makes the last stage's output layer score only the
positions whose next token is trainable, so ``loss_fn`` gets logits ``[1, K, V_pad/tp]``
(and the reference's likewise) instead of ``[b, s, V_pad/tp]``.

``loss`` must already be normalised by the *global* batch (the schedule is told
not to divide by the number of micro-batches); ``outputs`` are detached values.
"""
from __future__ import annotations

import contextlib
from functools import partial
from typing import Any, Callable, ContextManager, Optional

import torch

from grpo_mega.distributed.state import ParallelState


def causal_mask(seq_len: int, device) -> torch.Tensor:
    """Megatron's boolean mask convention: True means *masked*. Shape [1, 1, s, s]."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), 1)[None, None]


def _tokens(mb: Any) -> torch.Tensor:
    """The tokens the model runs on: ``[b, s]``, or ``[1, T]`` of a packed micro-batch."""
    packed = getattr(mb, "packed", None)
    if packed is not None:
        return packed.tokens
    return mb["tokens"] if isinstance(mb, dict) else mb.tokens


def model_inputs(mb: Any, device) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], dict]:
    """(tokens, position_ids, attention_mask, extra kwargs) of one forward of ``mb``: padded
    rows ``[b, s]`` with positions 0..s-1 and a causal mask, or a packed micro-batch
    (``mb.packed``, see ``models.packing``) as ``[1, T]`` with positions restarting per row,
    no mask, and its ``PackedSeqParams`` (the boundaries the attention keeps to)."""
    tokens = _tokens(mb).to(device)
    packed = getattr(mb, "packed", None)
    if packed is not None:
        return tokens, packed.position_ids, None, {"packed_seq_params": packed.params}
    b, s = tokens.shape
    pos = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
    return tokens, pos, causal_mask(s, tokens.device), {}


def run_microbatches(model, micro_batches: list[Any], loss_fn: Callable, ps: ParallelState,
                     *, forward_only: bool, reference=None,
                     around_forward: Optional[Callable[[Any], ContextManager]] = None,
                     logits_at: Optional[Callable[[Any, Any], ContextManager]] = None) -> list[dict]:
    """Each ``mb`` holds at least ``tokens: [b, s]`` (long). Returns ``loss_fn`` outputs
    per micro-batch on the last stage, ``[]`` on other stages. ``reference``: a frozen
    model whose logits shard of each micro-batch is passed to ``loss_fn`` (any PP).
    ``around_forward(mb)``: a context manager around the policy's forward of ``mb``.
    ``logits_at(model, mb)``: one around each model's forward of ``mb`` (see above)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not micro_batches:
        return []
    config = model.config
    piped = reference is not None and ps.pp > 1
    runner = _WithReference(model, reference) if piped else model
    if reference is not None and not piped:
        # megatron refreshes TE's FP8 weight casts only in the model it runs (see
        # _WithReference.set_is_first_microbatch); the reference rides along in forward_step.
        _refresh_fp8_weights(reference)
    config.variable_seq_lengths = ps.pp > 1
    # The schedule's p2p buffers use this dtype for activations.
    config.pipeline_dtype = next(model.parameters()).dtype

    def _at(m, mb) -> ContextManager:
        return logits_at(m, mb) if logits_at is not None else contextlib.nullcontext()

    def loss_func(mb, ref_logits, output_tensor):
        extra = () if ref_logits is None else (ref_logits,)
        loss, outputs = loss_fn(output_tensor, mb, *extra)
        # Third element is a token count the schedule adds up; we normalise ourselves.
        return loss, torch.ones((), dtype=torch.int), outputs

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        tokens, pos, mask, kw = model_inputs(mb, ps.device)
        policy = model.module if piped else model
        with around_forward(mb) if around_forward is not None else contextlib.nullcontext(), \
                _at(policy, mb):
            out = policy(tokens, pos, mask, **kw)
        ref_logits = None
        if reference is not None:
            with torch.no_grad(), _at(reference, mb):
                ref_logits = reference(tokens, pos, mask, **kw)
            if piped and not ps.is_last_stage:
                # Hidden states [s, b, h] of both models go to the next stage as one tensor.
                return torch.cat([out, ref_logits.to(out.dtype)], dim=1), partial(loss_func, mb, None)
        return out, partial(loss_func, mb, ref_logits)

    b, s = _tokens(micro_batches[0]).shape
    fb = get_forward_backward_func()
    if forward_only:
        ctx = torch.no_grad()
    else:
        ctx = torch.enable_grad()
    with ctx:
        outputs = fb(forward_step_func=forward_step, data_iterator=iter(micro_batches),
                     model=[runner], num_microbatches=len(micro_batches), seq_length=s,
                     micro_batch_size=b, forward_only=forward_only)
    return list(outputs) if ps.is_last_stage else []


def _refresh_fp8_weights(model) -> None:
    """Have TE recast ``model``'s FP8 weights at its next forward (megatron's
    ``MegatronModule.set_is_first_microbatch``; a no-op without FP8)."""
    refresh = getattr(model, "set_is_first_microbatch", None)
    if refresh is not None:
        refresh()


class _WithReference(torch.nn.Module):
    """The policy and the frozen reference as one pipeline stage for megatron's schedule.

    The activation received from the previous stage is ``[s, 2b, h]``: the policy's rows,
    then the reference's; ``set_input_tensor`` hands each model its half. The schedule finds
    ``config`` and ``model_type`` through ``module`` (megatron unwraps ``.module``)."""

    def __init__(self, policy, reference):
        super().__init__()
        self.module = policy
        self.reference = reference

    def set_is_first_microbatch(self) -> None:
        """megatron's schedule calls this on the model it runs, at a step's first micro-batch,
        if the model has it: TE then casts the weights to FP8 again (later micro-batches reuse
        the cast). Without it here the policy kept its first step's FP8 weights (PP > 1 with
        ``kl_kind: full``)."""
        _refresh_fp8_weights(self.module)
        _refresh_fp8_weights(self.reference)

    def set_input_tensor(self, input_tensor) -> None:
        x = input_tensor[0] if isinstance(input_tensor, list) else input_tensor
        if x is None:
            self.module.set_input_tensor(None)
            self.reference.set_input_tensor(None)
            return
        b = x.shape[1] // 2
        self.module.set_input_tensor(x[:, :b])
        self.reference.set_input_tensor(x[:, b:].detach())

