"""Start-up checks of the rollout placement and the asynchronous settings
(``rollout.placement``, ``rollout.engines``, ``rollout.engine_devices``,
``algorithm.max_staleness``, ``algorithm.off_policy``): each refusal names the flag."""
from __future__ import annotations

from grpo_mega.config import Config, ConfigError

PLACEMENTS = ("colocated", "separate")
OFF_POLICY = ("decoupled", "behaviour")


def check_placement(cfg: Config) -> None:
    r, a = cfg.rollout, cfg.algorithm
    if r.placement not in PLACEMENTS:
        raise ConfigError(f"rollout.placement={r.placement!r} is not one of {PLACEMENTS} (--rollout.placement)")
    if a.off_policy not in OFF_POLICY:
        raise ConfigError(f"algorithm.off_policy={a.off_policy!r} is not one of {OFF_POLICY} "
                          "(--algorithm.off_policy)")
    if isinstance(a.max_staleness, bool) or not isinstance(a.max_staleness, int) or a.max_staleness < 0:
        raise ConfigError(f"algorithm.max_staleness={a.max_staleness!r} must be an int >= 0 "
                          "(0: synchronous) (--algorithm.max_staleness)")
    if r.engines < 1:
        raise ConfigError(f"rollout.engines={r.engines} must be >= 1 (--rollout.engines)")
    if a.max_staleness and r.placement != "separate":
        raise ConfigError(f"algorithm.max_staleness={a.max_staleness} overlaps generation with the update, "
                          "which needs the engines on their own devices: set --rollout.placement=separate "
                          "(or --algorithm.max_staleness=0)")
    if r.placement == "separate":
        raise ConfigError("rollout.placement=separate is not available in this build yet (issue 29 in "
                          "progress); use --rollout.placement=colocated")
