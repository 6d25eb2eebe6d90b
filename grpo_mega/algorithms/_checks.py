"""Argument checks and collective helpers shared by the algorithm modules.

Bad input raises ValueError naming the offending argument, before any
collective can hang; shapes must match exactly (nothing is broadcast unless a
docstring says so). ``tp_group=None`` / ``dp_group=None`` mean a single rank.
"""
from __future__ import annotations

from typing import Tuple, Union

import torch
import torch.distributed as dist

Tensor = torch.Tensor
Count = Union[int, float, Tensor]


def _same_shape(a: Tensor, a_name: str, b: Tensor, b_name: str) -> None:
    if not isinstance(b, Tensor):
        raise ValueError(f"{b_name} must be a tensor, got {type(b).__name__}")
    if a.shape != b.shape:
        raise ValueError(
            f"{b_name} has shape {tuple(b.shape)} but {a_name} has {tuple(a.shape)}; "
            "shapes must match exactly (no broadcasting)")


def _tp_size_rank(group) -> Tuple[int, int]:
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _all_reduce(t: Tensor, op, group) -> Tensor:
    """In-place all-reduce, skipped for no group or a group of one (no collective at all)."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _check_logits(logits: Tensor, name: str) -> None:
    if not isinstance(logits, Tensor) or not logits.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor")
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"{name} must have a non-empty last (vocab) dim, got {tuple(logits.shape)}")


def _float(t: Tensor) -> Tensor:
    return t if t.is_floating_point() else t.float()


def _as_bool_mask(mask: Tensor) -> Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def _masked(values: Tensor, mask: Tensor) -> Tensor:
    # where, not multiply: inf/NaN at padded positions must not leak into sums.
    return torch.where(mask, values, torch.zeros_like(values))


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Detached mean of ``x`` [B, T] over the True entries of the bool ``mask`` [B, T] (0 if none)."""
    return (_masked(x.float(), mask).sum() / mask.sum().clamp(min=1)).detach()
