"""The multi-turn tool budget against the collective timeout, checked at start-up.

A turn's tool calls run on the rank that drives the episodes while every other rank waits in
a collective (``parallel.timeout_minutes``): the turn must end, or fail with an error that
names the flags, before that collective times out. ``validate`` checks it before any process
group exists (so the launcher's pre-check refuses it in one line), and the episodes set-up
checks it again where the budget is enforced.
"""
from __future__ import annotations

from grpo_mega.config import ConfigError

__all__ = ["BUDGET_SHARE", "check_env_budget", "turn_budget_seconds"]

BUDGET_SHARE = 0.8
"""The largest share of the collective timeout a turn's environment steps may take: the
rest covers the generate call and the broadcast around them."""


def turn_budget_seconds(cfg) -> float:
    """The budget in force: ``env.turn_budget_seconds``, or when null, 80% of the collective
    timeout (a fixed default did not fit a short timeout: 300 s against the demos' 5 minutes)."""
    e = cfg.env.turn_budget_seconds
    return BUDGET_SHARE * cfg.parallel.timeout_minutes * 60 if e is None else e


def check_env_budget(cfg) -> None:
    """``env.tool_workers`` >= 1 and 0 < ``env.turn_budget_seconds`` <= 80% of the collective
    timeout, else ConfigError naming the flags."""
    e, timeout_s, budget = cfg.env, cfg.parallel.timeout_minutes * 60, turn_budget_seconds(cfg)
    if not (isinstance(e.tool_workers, int) and e.tool_workers >= 1):
        raise ConfigError(f"env.tool_workers={e.tool_workers!r} must be an integer >= 1 (--env.tool_workers)")
    if not 0 < budget <= BUDGET_SHARE * timeout_s:
        raise ConfigError(f"env.turn_budget_seconds={budget!r} must be > 0 and at most "
                          f"{BUDGET_SHARE:.0%} of the collective timeout (parallel.timeout_minutes="
                          f"{cfg.parallel.timeout_minutes:g}: {BUDGET_SHARE * timeout_s:g} s); lower "
                          "--env.turn_budget_seconds or raise --parallel.timeout_minutes")
