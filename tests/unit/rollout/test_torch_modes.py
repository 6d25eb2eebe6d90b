"""``rollout.torch_modes.outside_torch_function_modes``: vLLM runs outside the strict device
check's TorchFunctionMode, and the check is back on afterwards."""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from grpo_mega.rollout.torch_modes import outside_torch_function_modes


class _Count(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_engine_calls_run_outside_the_modes_and_the_modes_come_back():
    """Guards against the engine's calls still paying a Python call per torch op under the
    suite's strict device check (a world-4 scale test: 309 -> 167 CPU-s), and against the
    check switched off for the rest of the process after the first generate (modes popped
    and never pushed back: every later host tensor handed to a collective goes unseen)."""
    outer, inner = _Count(), _Count()
    with outer, inner:
        torch.ones(2) + 1
        seen = (outer.calls, inner.calls)
        with outside_torch_function_modes():
            torch.ones(2) + 1
        assert (outer.calls, inner.calls) == seen  # nothing reached either mode
        torch.ones(2) + 1
        assert inner.calls > seen[1] and outer.calls > seen[0]  # both back, in their order
    with outside_torch_function_modes():  # no mode pushed: a no-op
        assert torch.ones(1).item() == 1.0
