"""Errors that happen on one rank, raised on every rank of a group.

Work done by one rank and sent to the others (rewards scored on the replica leader)
must not leave the others blocked in the broadcast when it fails: they would wait until
the collective timeout or torchrun's teardown, and the user would read a timeout
instead of the cause. ``run_on_src`` sends the error in place of the result, so every
rank raises the same message, naming the rank where it happened, at once.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch.distributed as dist


class RemoteError(RuntimeError):
    """The shared work failed on rank ``src``; the message carries that rank's error."""


def run_on_src(fn: Callable[[], Any], src: int, group: Optional[dist.ProcessGroup], what: str) -> Any:
    """Collective over ``group``: global rank ``src`` runs ``fn()`` and every rank gets its
    result. If ``fn`` raises, every rank raises ``RemoteError`` naming ``what``, ``src`` and
    the error (on ``src`` chained to the original). ``group`` None: ``fn()`` here, as is."""
    if group is None:
        return fn()
    error, result, cause = None, None, None
    if dist.get_rank() == src:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - sent to every rank, re-raised below
            error, cause = f"{type(e).__name__}: {e}", e
    box = [(error, result)]
    dist.broadcast_object_list(box, src=src, group=group)
    error, result = box[0]
    if error is not None:
        raise RemoteError(f"{what} failed on rank {src}: {error}") from cause
    return result
