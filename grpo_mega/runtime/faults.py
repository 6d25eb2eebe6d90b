"""Fault injection for tests: make a run fail on purpose at a named point of the step.

    GRPO_MEGA_FAULT="point[:action][:k][@rank][#step[+]]"

``point`` is where the hook sits (``POINTS``); ``action`` is ``raise`` (default: a
``FaultInjected`` error), ``kill`` (SIGKILL this process, no cleanup, as an OOM killer
or a lost node would), ``nan`` (the caller poisons a gradient; only ``update`` uses it) or
``hold`` (print the line and stop here for good, so that a test can SIGKILL the whole job
from outside, torchrun and every rank at once, while this rank is at the point).
``k`` counts within the point where it has a count (``bridge.sync``: after the k-th
bucket; default 1). ``@rank`` limits it to one global rank; ``#N`` to step N, ``#N+``
to step N and every later one. Examples::

    GRPO_MEGA_FAULT=checkpoint.save:kill#4      # die mid-write of the step-4 checkpoint
    GRPO_MEGA_FAULT=bridge.sync:kill:2          # die after the 2nd bucket of a weight sync
    GRPO_MEGA_FAULT=update:nan#3+               # NaN gradients from step 3 on
    GRPO_MEGA_FAULT=step:kill@1#3               # rank 1 dies as step 3 starts
    GRPO_MEGA_FAULT=checkpoint.rotate:hold@0#3  # rank 0 stops mid-rotation of keep_last

The variable is read once, at import; unset, ``fault_point`` is one comparison. This
module imports nothing of ours, so every part of the package may call it.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Optional

POINTS = ("step", "rollout.generate", "reward.score", "update", "bridge.sync", "checkpoint.save",
          "checkpoint.rotate", "checkpoint.republish", "async.submit", "async.collect", "remote.start")
"""``checkpoint.republish``: a step saved again (a finished command re-run) after the old copy
was renamed aside and before the new one is in place. ``async.*``: asynchronous GRPO (``algorithm.max_staleness``): ``async.submit`` as a step's
prompts go to the engines, ``async.collect`` as the trainer takes a batch whose generation
overlapped the previous update (the engines are generating when it fires). ``remote.start``:
in an engine server process, after it has its configuration and before it builds its engine
(``hold`` there stands for a long vLLM start, during which the server reads no messages)."""
ACTIONS = ("raise", "kill", "nan", "hold")
ENV = "GRPO_MEGA_FAULT"


class FaultInjected(RuntimeError):
    """Raised at a fault point by ``GRPO_MEGA_FAULT=<point>:raise``."""


@dataclass(frozen=True)
class Fault:
    point: str
    action: str = "raise"
    k: int = 1
    rank: Optional[int] = None
    step: Optional[int] = None
    onwards: bool = False
    """``#N+``: every step from N on, not only step N."""


def parse(spec: str) -> Fault:
    """``"point[:action][:k][@rank][#step[+]]"`` -> Fault; a bad spec names the variable."""
    def bad(why: str) -> ValueError:
        return ValueError(f"{ENV}={spec!r}: {why}; the form is point[:action][:k][@rank][#step[+]] "
                          f"with point in {POINTS} and action in {ACTIONS}")

    body, step, onwards = spec.strip(), None, False
    try:
        if "#" in body:
            body, s = body.split("#", 1)
            onwards = s.endswith("+")
            step = int(s.rstrip("+"))
        rank = None
        if "@" in body:
            body, r = body.split("@", 1)
            rank = int(r)
        parts = body.split(":")
        point, action = parts[0], parts[1] if len(parts) > 1 else "raise"
        k = int(parts[2]) if len(parts) > 2 else 1
    except ValueError:
        raise bad("a step, rank or count is not an integer") from None
    if point not in POINTS:
        raise bad(f"unknown point {point!r}")
    if action not in ACTIONS:
        raise bad(f"unknown action {action!r}")
    if action == "nan" and point != "update":
        raise bad("only the update point can inject a NaN")
    return Fault(point, action, k, rank, step, onwards)


_FAULT: Optional[Fault] = parse(os.environ[ENV]) if os.environ.get(ENV) else None
_step = 0


def set_step(step: int) -> None:
    """The training loop's current step, which ``#step`` matches against."""
    global _step
    _step = step


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def fault_point(point: str, k: int = 1) -> bool:
    """Fail here if ``GRPO_MEGA_FAULT`` names this point (and this rank, step and count ``k``).
    Returns True for a ``nan`` fault, which the caller injects; else False."""
    f = _FAULT
    if f is None or f.point != point:
        return False
    if f.k != k or (f.rank is not None and f.rank != _rank()):
        return False
    if f.step is not None and not (_step >= f.step if f.onwards else _step == f.step):
        return False
    where = f"{point} (rank {_rank()}, step {_step}{f', count {k}' if k != 1 else ''})"
    # Printed first, so a test can time the fault to every rank's exit.
    print(f"[grpo] fault injected: {f.action} at {where}", flush=True)
    if f.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if f.action == "hold":
        while True:
            time.sleep(3600)
    if f.action == "nan":
        return True
    raise FaultInjected(f"fault injected at {where} by {ENV}")
