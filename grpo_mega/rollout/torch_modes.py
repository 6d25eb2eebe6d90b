"""Running vLLM outside the torch function modes a process has pushed."""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def outside_torch_function_modes():
    """Run vLLM outside any ``TorchFunctionMode`` this process has pushed: the CPU suite's
    strict device check (``distributed/strict_devices.py``, ``GRPO_MEGA_STRICT_DEVICES=1``)
    routes every torch op through a Python call, which made a world-4 test's engine steps
    (an MoE model on an engine of 4 ranks) take most of its 300 CPU-s. vLLM's tensors are
    its own, which that check never tags, so nothing it checks runs in here. A no-op where
    no mode is pushed (every GPU job)."""
    try:  # torch's own helpers (private): a torch without them runs vLLM as it is
        from torch.overrides import _get_current_function_mode_stack, _pop_mode, _push_mode
    except ImportError:  # pragma: no cover
        yield
        return
    popped = []
    while _get_current_function_mode_stack():
        popped.append(_pop_mode())
    try:
        yield
    finally:
        for mode in reversed(popped):
            _push_mode(mode)
