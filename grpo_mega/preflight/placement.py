"""Start-up checks of the rollout placement and the asynchronous settings
(``rollout.placement``, ``rollout.engines``, ``rollout.engine_devices``,
``algorithm.max_staleness``, ``algorithm.off_policy``) and of where episodes come from
(``gateway.*``): each refusal names the flag."""
from __future__ import annotations

from grpo_mega.config import Config, ConfigError
from grpo_mega.config.gateway import GATEWAY_REWRITE_POLICIES, GATEWAY_SAMPLING_POLICIES

PLACEMENTS = ("colocated", "separate")


def check_placement(cfg: Config) -> None:
    r, a = cfg.rollout, cfg.algorithm
    if r.placement not in PLACEMENTS:
        raise ConfigError(f"rollout.placement={r.placement!r} is not one of {PLACEMENTS} (--rollout.placement)")
    # algorithm.off_policy names are checked against its registry (validate.registry_choices).
    if a.off_policy == "behaviour" and a.tis_cap is not None:
        raise ConfigError(f"algorithm.tis_cap={a.tis_cap} caps the importance weight proximal/behaviour of "
                          "algorithm.off_policy=decoupled; off_policy=behaviour clips against the rollout's "
                          "log-probs with no weight: set --algorithm.tis_cap=null or "
                          "--algorithm.off_policy=decoupled")
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
        _check_separate(cfg)
    check_gateway(cfg)


def check_gateway(cfg: Config) -> None:
    """``gateway.*``: the policies are known, the limits sane, and the run is one the
    gateway can feed (colocated engines of any layout; not with an environment)."""
    g = cfg.gateway
    for name, allowed in (("sampling_policy", GATEWAY_SAMPLING_POLICIES), ("on_rewrite", GATEWAY_REWRITE_POLICIES)):
        if getattr(g, name) not in allowed:
            raise ConfigError(f"gateway.{name}={getattr(g, name)!r} is not one of {allowed} (--gateway.{name})")
    if not 0 <= g.port < 65536 or g.max_tokens < 1 or g.max_connections < 1 or not g.episode_timeout_seconds > 0:
        raise ConfigError(f"gateway.port={g.port} must be a TCP port (0: a free one), gateway.max_tokens={g.max_tokens}, "
                          f"gateway.max_connections={g.max_connections} >= 1 and gateway.episode_timeout_seconds="
                          f"{g.episode_timeout_seconds} > 0")
    if not g.enabled:
        return
    if cfg.env.name:
        raise ConfigError(f"gateway.enabled with env.name={cfg.env.name!r}: the agent program is the environment "
                          "(--env.name=null, or --gateway.enabled=false)")
    if cfg.rollout.placement == "separate":
        raise ConfigError("gateway.enabled with rollout.placement=separate is not supported yet: the gateway "
                          "drives colocated engines (any rollout.tp, several replicas) (--rollout.placement=colocated)")
    if cfg.algorithm.advantage == "process":
        raise ConfigError("algorithm.advantage=process scores reasoning steps of one response; with gateway.enabled "
                          "the agent gives each episode one reward (--algorithm.advantage=outcome)")


def _check_separate(cfg: Config) -> None:
    r, a = cfg.rollout, cfg.algorithm
    if r.tp not in (0, 1) or (r.tp == 0 and cfg.parallel.tp != 1):
        # Each engine server hosts vLLM in its own process with the uni executor.
        raise ConfigError(f"rollout.placement=separate runs each engine on one device; rollout.tp="
                          f"{r.tp or cfg.parallel.tp} is not supported there yet: set --rollout.tp=1 "
                          "(more engines: --rollout.engines)")
    # Multi-turn episodes (env.name) and DAPO (algorithm.dynamic_sampling) are supported here:
    # episodes are played against the engine servers with per-token version stamps across
    # turns, and DAPO rounds take the pipeline's next draws in data order (trainer.pipeline).
    if r.engine_devices and len(r.engine_devices) != r.engines:
        raise ConfigError(f"rollout.engine_devices lists {len(r.engine_devices)} device(s) for "
                          f"rollout.engines={r.engines} engines of one device each (--rollout.engine_devices)")
    if len(set(r.engine_devices)) != len(r.engine_devices):
        raise ConfigError(f"rollout.engine_devices={r.engine_devices} names a device twice (--rollout.engine_devices)")
