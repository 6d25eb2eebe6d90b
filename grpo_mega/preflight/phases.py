"""The memory phases of a GRPO run on one GPU, and what each holds (``budget.py``'s peak is
the largest of them).

One step on a colocated GPU runs, in order (``train.py``, ``rollout/sleep.py``):

    rollout    the engine awake with its whole ``rollout.gpu_memory_utilization`` share
    reference  engine asleep; forward-only reference / old-policy log-probs
    update     engine asleep; activations, logits, the step's gradients
    wake-up    torch's cache emptied; the engine's weights mapped back
    sync       the weights loaded, one bucket (``rollout.sync_bucket_mb``) at a time
    save       when due: engine released again (``train.py`` ``save``); the optimizer's whole
               state gathered to host memory chunk by chunk

What every phase holds is the trainer's resident rows (weights, a persistent grad buffer,
optimizer, reference, FP8 weight caches), the engine's part, and ``RUNTIME_RESERVE_GIB``.
The engine's part: its share while awake; while it sleeps, vLLM's CUDA-graph pool
(``CUDA_GRAPH_POOL_GIB``), which vLLM profiles into its share (since 0.21) but sleep mode
does not release (it frees only the memory tagged weights and KV cache); nothing on a
trainer GPU of ``rollout.placement: separate``. Pure arithmetic on GiB figures.
"""
from __future__ import annotations

from dataclasses import dataclass

RUNTIME_RESERVE_GIB = 3.0
"""CUDA context, NCCL buffers and allocator fragmentation per GPU."""
CUDA_GRAPH_POOL_GIB = 1.0
"""vLLM's CUDA-graph memory pool per GPU (vLLM logs its estimate at start-up, "Estimated
CUDA graph memory"; 0.4-1 GiB for 7B-70B at TP 2-8 with the default capture sizes)."""
SAVE_GATHER_GIB = 0.25
"""Accelerator memory the grpo distributed optimizer's save gather takes at a time
(``optim/distributed.py`` ``GATHER_CHUNK_BYTES``; a test ties the two)."""


@dataclass
class Row:
    name: str
    gib: float
    note: str = ""
    resident: bool = True
    """Held in every phase (weights, optimizer state), not only in the update."""


def graph_pool_gib(enforce_eager: bool | None) -> float:
    """The CUDA-graph pool an engine keeps while asleep: none with ``rollout.enforce_eager``
    true (no graphs are captured), else ``CUDA_GRAPH_POOL_GIB``."""
    return 0.0 if enforce_eager else CUDA_GRAPH_POOL_GIB


def engine_asleep_gib(placement: str, sleeps: bool, share: float, graph_pool: float = CUDA_GRAPH_POOL_GIB) -> float:
    """What the engine holds on a trainer GPU while released: 0 (separate placement), its
    CUDA-graph pool (sleep mode), or its whole share (an engine that does not sleep)."""
    if placement == "separate":
        return 0.0
    return graph_pool if sleeps else share


def phase_rows(trainer: list[Row], *, placement: str, sleeps: bool, share: float, engine_weights: float,
               reference_extra: float, sync_bucket: float, save_gather: float,
               graph_pool: float = CUDA_GRAPH_POOL_GIB) -> list[Row]:
    """Per-GPU GiB of each phase (``Row.note`` says what it holds). ``reference_extra``:
    what the forward-only log-probs add (logits, an offloaded reference brought back);
    ``save_gather``: the save's transient on the accelerator."""
    resident = sum(r.gib for r in trainer if r.resident)
    update = sum(r.gib for r in trainer if not r.resident)
    held = f"trainer state {resident:.2f}"
    asleep = engine_asleep_gib(placement, sleeps, share, graph_pool)
    if placement == "separate":
        awake, woken, what = 0.0, 0.0, "no engine on this GPU"
    elif sleeps:
        awake, woken, what = share, graph_pool + engine_weights, "engine's CUDA-graph pool"
    else:
        awake, woken, what = share, share, "engine awake (rollout.sleep_between_rollouts=false)"
    r = RUNTIME_RESERVE_GIB
    wake = resident + woken + r
    return [
        Row("rollout", resident + awake + r, f"{held} + engine share {awake:.2f} + reserve"),
        Row("reference", resident + reference_extra + asleep + r,
            f"{held} + forward-only log-probs {reference_extra:.2f} + {what} + reserve"),
        Row("update", resident + update + asleep + r,
            f"{held} + step gradients, activations, logits {update:.2f} + {what} + reserve"),
        Row("wake-up", wake, f"{held} + engine weights and graph pool {woken:.2f} + reserve; KV cache after the sync"),
        Row("sync", wake + sync_bucket, f"wake-up + one sync bucket {sync_bucket:.2f}"),
        Row("save", resident + save_gather + asleep + r,
            f"{held} + gather chunk {save_gather:.2f} (whole state to host) + {what} + reserve"),
    ]
