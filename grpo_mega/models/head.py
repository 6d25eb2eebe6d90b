"""The output layer at the trainable positions only: logits ``[1, K, V_pad/tp]``, not ``[b, s, V_pad/tp]``.

Why: the loss reads log-probs (and entropy, KL) only where the next token is the model's own
(``loss_mask: [b, s-1]``). A multi-turn episode of 16k tokens with 1k model tokens, or a
single-turn sample with a long prompt, would otherwise run the output layer and keep
vocabulary-wide logits and their gradient for every prompt and tool position.

How: ``trainable_logits(model, loss_mask)`` is a context manager around one forward of the
megatron ``GPTModel``. A forward pre-hook on megatron's own output layer (its
``ColumnParallelLinear``, tied embeddings included: ``GPTModel`` passes the weight) swaps
the hidden states it receives ``[s, b, h]`` for the selected rows ``[K, 1, h]``, so the
model returns ``[1, K, V_pad/tp]``, row k the position of the k-th True of ``loss_mask``
(row-major). Nothing else of the forward changes: the decoder, MoE routing (replay
included) and recomputation see every token as before.

Sequence parallelism: the hidden states reach the output layer split along the sequence
over the TP ranks (``[s/tp, b, h]``) and the layer would all-gather them itself. Here they
are gathered first (``gather_from_sequence_parallel_region`` without the reduce-scatter in
the backward: the layer's input gradient is all-reduced over TP instead), the rows are
selected from the whole sequence, and the layer runs with ``sequence_parallel`` off for
that call, as megatron's own last-token inference path does in ``GPTModel._postprocess``.

Pipeline parallelism: only the last stage has an output layer; elsewhere the context does
nothing. The output layer is megatron's (not a TE GEMM, never FP8), so K needs no padding.
Finding the rows costs a host sync per forward (``nonzero``), as does the loss's
``targets[loss_mask]``: a few per micro-batch, against a ``[K, V/tp]`` GEMM.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch import Tensor

from grpo_mega.models.gpt import unwrap_model
from grpo_mega.models.packing import PackedRows, trainable_rows_packed

__all__ = ["trainable_rows", "trainable_logits"]


def trainable_rows(loss_mask: Tensor) -> Tensor:
    """``loss_mask: [b, s-1]`` bool (True where ``tokens[i, t+1]`` is trainable) -> ``[K]``
    long: rows of the ``[s * b, h]`` hidden states (megatron's ``[s, b, h]``, sequence-major:
    row ``t * b + i``) whose logits predict a trainable token, in the mask's row-major order."""
    if loss_mask.dim() != 2 or loss_mask.dtype != torch.bool:
        raise ValueError(f"loss_mask must be a [b, s-1] bool tensor, got {loss_mask.dtype} "
                         f"{tuple(loss_mask.shape)}")
    seq, pos = loss_mask.nonzero(as_tuple=True)
    return pos * loss_mask.shape[0] + seq


@contextlib.contextmanager
def trainable_logits(model, loss_mask: Tensor, packed: Optional[PackedRows] = None) -> Iterator[None]:
    """Inside, one forward of ``model`` on tokens ``[b, s]`` returns logits ``[1, K, V_pad/tp]``
    at the positions where ``loss_mask: [b, s-1]`` is True (the same on every TP rank); a
    stage without an output layer is left alone. ``packed``: the forward runs on the packed
    ``[1, T]`` layout of those rows (``models.packing``); the logits are the same rows in the
    same order."""
    gpt = unwrap_model(model)
    layer = getattr(gpt, "output_layer", None)
    if not getattr(gpt, "post_process", False) or layer is None:
        yield
        return
    if packed is None:
        rows, positions = trainable_rows(loss_mask), loss_mask.shape[0] * (loss_mask.shape[1] + 1)
    else:
        rows, positions = trainable_rows_packed(loss_mask, packed.starts), packed.total
    split = bool(getattr(layer, "sequence_parallel", False))

    def select(module, args, kwargs):
        hidden = args[0]  # [s, b, h], or [s/tp, b, h] under sequence parallelism
        if split:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False,
                                                          group=module.tp_group)
        if hidden.shape[0] * hidden.shape[1] != positions:
            raise ValueError(f"output layer input {tuple(hidden.shape)} does not hold the {positions} "
                             f"positions of loss_mask {tuple(loss_mask.shape)}"
                             + (f" packed into {packed.total}" if packed is not None else ""))
        picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows).unsqueeze(1)  # [K, 1, h]
        return (picked, *args[1:]), kwargs

    handle = layer.register_forward_pre_hook(select, with_kwargs=True)
    if split:
        layer.sequence_parallel = False  # the selected rows are whole on every TP rank
    try:
        yield
    finally:
        handle.remove()
        if split:
            layer.sequence_parallel = True
