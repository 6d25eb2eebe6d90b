"""MoE routing replay: record the experts each token is routed to, and force them later.

Why: in off-policy GRPO the update forward runs with weights that have already taken
optimizer steps (later mini-batches, PPO epochs). A small weight change can flip a
token's top-k experts, and then the importance ratio compares two different networks
instead of two nearby policies. Replaying a fixed routing keeps the ratio about the
weights only (``algorithm.routing_replay``).

How: megatron-core's ``RouterReplay`` (megatron/core/transformer/moe/router_replay.py)
sits inside each ``Router``'s top-k: with action RECORD it keeps the top-k indices it
computed, with REPLAY_FORWARD it takes given indices and gathers their scores (the
router still gets gradients through them). This module installs one per router of *one*
model (megatron's own static list would mix the actor's and the reference's layers) and
converts between the router's token order and the batch's.

Layouts. The batch keeps routing as ``routed: [b, s, L, k]`` (int16 global expert ids;
``L`` = all layers of the model, a PP stage filling and reading only its own; position
``t`` is the routing computed *at* token ``t``, aligned with ``tokens[:, t]``). A router
sees its stage's activations ``[s, b, h]`` flattened, so its rows are ``[s * b, k]``,
sequence-major. Routing is per token before the dispatcher, so EP does not change what a
rank records or replays (each rank routes its own DP rows); at TP > 1 without sequence
parallelism every TP rank routes the same tokens identically.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import Tensor

__all__ = ["ROUTING_REPLAY_MODES", "empty_routing", "install_router_replay", "routers", "to_router_rows",
           "from_router_rows", "recording", "replaying"]

ROUTING_REPLAY_MODES = ("off", "replay", "record-in-trainer")


def routers(model) -> list[tuple[int, object]]:
    """(global layer index, Router) of this stage's MoE layers, in layer order."""
    from megatron.core.transformer.moe.router import Router

    out = [(mod.layer_number - 1, mod) for mod in model.modules() if isinstance(mod, Router)]
    return sorted(out, key=lambda x: x[0])


def install_router_replay(model) -> int:
    """Give every router of ``model`` its own ``RouterReplay`` (idle until an action is set);
    returns how many. Megatron registers each instance in a process-wide list; this module
    reaches them through the model only, so they are taken off that list (a process that
    builds several models, the reference or tests, would otherwise keep them all alive)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    found = routers(model)
    for _, router in found:
        if router.router_replay is None:
            router.router_replay = RouterReplay()
            RouterReplay.global_router_replay_instances.remove(router.router_replay)
    return len(found)


def to_router_rows(routed: Tensor) -> Tensor:
    """``routed: [b, s, L, k]`` -> ``[L, s * b, k]`` int64, each layer in the router's
    sequence-major row order (row ``t * b + i`` is token ``t`` of sequence ``i``)."""
    b, s, n_layers, k = routed.shape
    return routed.permute(2, 1, 0, 3).reshape(n_layers, s * b, k).long()


def from_router_rows(rows: Tensor, b: int, s: int) -> Tensor:
    """``rows: [s * b, k]`` of one router -> ``[b, s, k]`` (inverse of ``to_router_rows``)."""
    return rows.reshape(s, b, -1).transpose(0, 1)


def _replays(model) -> list[tuple[int, object]]:
    found = [(layer, r.router_replay) for layer, r in routers(model)]
    if any(rr is None for _, rr in found):
        raise RuntimeError("routing replay needs models.routing.install_router_replay(model) after "
                           "build_model (algorithm.routing_replay)")
    return found


@contextlib.contextmanager
def recording(model, out: Tensor, packed=None) -> Iterator[None]:
    """Record this stage's routing of one forward into ``out: [b, s, L, k]`` (its layers'
    slots; ``b, s`` the forward's token shape); the routers are idle again afterwards.
    ``packed`` (``models.packing.PackedRows``): the forward ran on the packed rows; each real
    token's routing goes to its grid slot, the tail's nowhere."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    found = _replays(model)
    for _, rr in found:
        rr.set_router_replay_action(RouterReplayAction.RECORD)
    try:
        yield
        b, s = out.shape[:2]
        for layer, rr in found:
            idx = rr.get_recorded_indices()
            if idx is None:
                raise RuntimeError(f"layer {layer}'s router recorded nothing in this forward")
            if packed is None:
                out[:, :, layer].copy_(from_router_rows(idx, b, s))
            else:
                out[packed.rows, packed.cols, layer] = idx[:packed.rows.shape[0]].to(out.dtype)
    finally:
        for _, rr in found:
            rr.clear_router_replay_action()
            rr.clear_indices()


@contextlib.contextmanager
def replaying(model, routed: Tensor, packed=None) -> Iterator[None]:
    """Force the routing ``routed: [b, s, L, k]`` on this stage's routers for one forward
    (their layers' slots); the routers are idle again afterwards. Only the forward: a
    recompute of the layer in the backward would route anew (``model.recompute=full``
    is refused with routing replay). ``packed``: the forward runs on the packed rows
    (``models.packing.PackedRows``); the tail's positions, scored by nothing, go to experts
    0..k-1."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    found = _replays(model)
    rows = to_router_rows(routed) if packed is None else _packed_router_rows(routed, packed)
    mine = [layer for layer, _ in found]
    # one host sync per micro-batch; a -1 left in would fail deep inside the router (a
    # device-side assert on GPU)
    if mine and bool((rows[mine] < 0).any()):
        raise RuntimeError(f"routing replay: layers {mine} hold unrecorded positions (-1) in this "
                           "micro-batch; the old-policy pass must record them first")
    for layer, rr in found:
        rr.set_target_indices(rows[layer])
        rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        yield
    finally:
        for _, rr in found:
            rr.clear_router_replay_action()
            rr.clear_indices()


def _packed_router_rows(routed: Tensor, packed) -> Tensor:
    """``routed: [b, s, L, k]`` -> ``[L, T, k]`` int64 in the packed order of ``packed``."""
    real = routed[packed.rows, packed.cols]                       # [total, L, k]
    tail = torch.arange(real.shape[-1], device=real.device).expand(packed.pad, *real.shape[1:])
    return torch.cat([real.long(), tail], dim=0).permute(1, 0, 2).contiguous()


def empty_routing(n: int, s: int, num_layers: int, topk: int, device) -> Tensor:
    """A ``[n, s, L, k]`` int16 buffer of -1 (no routing yet): a slot left unfilled fails
    loudly as an index when replayed."""
    return torch.full((n, s, num_layers, topk), -1, dtype=torch.int16, device=device)
