"""NCCL's device rule on a CPU job: host tensors handed to collectives are rejected.

On a GPU job every group is NCCL, and a CPU tensor given to ``dist.all_reduce`` (or any
tensor collective) raises ``No backend type associated with device type cpu``. On CPU the
job's device *is* the host, so gloo accepts everything and that class of bug hides. This
module makes it visible in the CPU suite:

* a ``TorchFunctionMode`` tags every tensor that grpo_mega code makes with a factory call
  (``torch.tensor``, ``zeros``, ``from_numpy``...) WITHOUT ``device=``: on a GPU that
  tensor would live on the host. Tags follow ops whose tensor inputs are all tagged
  (``torch.tensor(x).double()`` is still host scratch); ``.to(device)``/``.cuda()`` and
  factories given ``device=`` make untagged (device) tensors, ``.cpu()`` a tagged one;
* the ``torch.distributed`` tensor collectives are wrapped to raise NCCL's error, naming
  where the tensor was made, when they get a tagged tensor. Object collectives
  (``broadcast_object_list``, ``all_gather_object``) move pickles and are exempt.

Only tensors made in grpo_mega's own frames are tagged, so megatron's and vLLM's internal
collectives on their own tensors never trip it. Limits: ``device="cpu"`` written literally
counts as a device tensor (on CPU it cannot be told from ``ps.device``), and tensors
made by C code (safetensors, torch.load) are not tagged.

Enabled by ``GRPO_MEGA_STRICT_DEVICES=1`` in ``init_parallel`` on CPU only (the multi-rank
test launchers set it); on GPU the real NCCL does the check.
"""
from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

ENV = "GRPO_MEGA_STRICT_DEVICES"
_TAG = "_grpo_host_site"
_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_SELF = os.path.abspath(__file__)
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep

_FACTORIES = {torch.tensor, torch.as_tensor, torch.asarray, torch.from_numpy, torch.zeros, torch.ones,
              torch.empty, torch.full, torch.arange, torch.linspace, torch.logspace, torch.rand,
              torch.randn, torch.randint, torch.randperm, torch.eye, torch.empty_strided,
              torch.scalar_tensor, torch.frombuffer}
_TO_DEVICE = {torch.Tensor.to, torch.Tensor.cuda}
_TO_HOST = {torch.Tensor.cpu, torch.Tensor.pin_memory}
# Tensor collectives, by the positional index of their tensor (or list of tensors) arguments.
_COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
                "_all_gather_base", "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base",
                "all_to_all", "all_to_all_single", "gather", "scatter", "send", "recv", "isend",
                "irecv", "all_reduce_coalesced", "all_gather_coalesced")
_wrapped: dict[str, Any] = {}
_mode: "_HostTagMode | None" = None


def site_of(t: Any) -> str | None:
    """Where a host-scratch tensor was made ("file:line"), or None for a device tensor."""
    return getattr(t, _TAG, None)


def _caller_site() -> str | None:
    """The first frame outside torch and this module, if it is grpo_mega code."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if name != _SELF and not name.startswith(_TORCH):
            return f"{name}:{f.f_lineno}" if name.startswith(_PKG) else None
        f = f.f_back
    return None


def _tensors(obj: Any):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            if isinstance(o, torch.Tensor):
                yield o


def _tag(out: Any, site: str, fresh_from: tuple = ()) -> Any:
    for t in _tensors(out):
        if not any(t is a for a in fresh_from):  # never retag an input (in-place ops)
            setattr(t, _TAG, site)
    return out


def _names_device(args: tuple, kwargs: dict) -> bool:
    if kwargs.get("device") is not None:
        return True
    return any(isinstance(a, (torch.device, str, int, torch.Tensor)) and not isinstance(a, bool)
               for a in args[1:])


class _HostTagMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FACTORIES:
            out = func(*args, **kwargs)
            if kwargs.get("device") is None:
                site = _caller_site()
                if site is not None:
                    _tag(out, site)
            return out
        if func in _TO_DEVICE and args and site_of(args[0]) is not None:
            out = func(*args, **kwargs)
            if func is torch.Tensor.cuda or _names_device(args, kwargs):
                if out is args[0]:  # a no-op move on CPU: an untagged alias stands for the copy
                    out = out.view_as(out)
                if site_of(out) is not None:
                    delattr(out, _TAG)
            return out
        if func in _TO_HOST and args:
            site = _caller_site()
            out = func(*args, **kwargs)
            if site is not None and site_of(out) is None:
                out = out.view_as(out) if out is args[0] else out
                _tag(out, site)
            return out
        out = func(*args, **kwargs)
        ins = [t for a in args for t in _tensors(a)] + [t for a in kwargs.values() for t in _tensors(a)]
        if ins and all(site_of(t) is not None for t in ins) and not isinstance(out, bool):
            _tag(out, site_of(ins[0]), tuple(ins))
        return out


def _check(name: str, args: tuple, kwargs: dict) -> None:
    for a in list(args) + list(kwargs.values()):
        items = a if isinstance(a, (list, tuple)) else [a]
        for t in items:
            t = getattr(t, "tensor", t)  # P2POp
            site = site_of(t)
            if site is not None:
                raise RuntimeError(
                    f"No backend type associated with device type cpu: dist.{name} got a host tensor "
                    f"made at {site} without device= (on a GPU job's NCCL group this is the error you "
                    f"get; make it with device=ps.device or move it with .to(ps.device)). "
                    f"Raised by the strict device check ({ENV}=1).")


def _wrap(name: str, fn):
    def checked(*args, **kwargs):
        _check(name, args, kwargs)
        return fn(*args, **kwargs)
    checked.__name__ = checked.__qualname__ = name
    checked.__wrapped__ = fn
    return checked


def _check_p2p_list(fn):
    def checked(p2p_op_list, *a, **k):
        _check("batch_isend_irecv", (list(p2p_op_list),), {})
        return fn(p2p_op_list, *a, **k)
    checked.__wrapped__ = fn
    return checked


def enable() -> None:
    """Tag host tensors and check the collectives, for the rest of this process."""
    global _mode
    if _mode is not None:
        return
    import torch.distributed.distributed_c10d as c10d
    for name in _COLLECTIVES + ("batch_isend_irecv",):
        fn = getattr(c10d, name, None)
        if fn is None:
            continue
        new = _check_p2p_list(fn) if name == "batch_isend_irecv" else _wrap(name, fn)
        _wrapped[name] = fn
        setattr(c10d, name, new)
        if getattr(dist, name, None) is fn:
            setattr(dist, name, new)
    _mode = _HostTagMode()
    _mode.__enter__()


def enabled() -> bool:
    return _mode is not None


def enable_from_env() -> bool:
    """``enable()`` when ``GRPO_MEGA_STRICT_DEVICES=1`` (CPU jobs; see the module docstring)."""
    if os.environ.get(ENV, "") not in ("", "0") and not torch.cuda.is_available():
        enable()
    return enabled()
