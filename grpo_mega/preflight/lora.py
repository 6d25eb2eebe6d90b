"""Start-up checks of ``model.lora`` (``grpo_mega.lora``): the knobs' ranges, and the
combinations LoRA does not support yet, each refused with the flag that fixes it."""
from __future__ import annotations

from grpo_mega.config import LORA_TARGETS, Config, ConfigError

LORA_SYNCS = ("merged", "adapter")
LORA_INIT_NAMES = ("kaiming", "gaussian")  # grpo_mega.lora.LORA_INITS (a test keeps them equal)


def lora_choices() -> dict:
    """(``model.lora``, field) -> allowed values, for the config reference."""
    return {("model.lora", "init"): LORA_INIT_NAMES, ("model.lora", "sync"): LORA_SYNCS,
            ("model.lora", "target_modules"): LORA_TARGETS}


def check_lora(cfg: Config) -> None:
    """Raise ConfigError for a bad ``model.lora`` or a combination it cannot run."""
    lora, m, a = cfg.model.lora, cfg.model, cfg.algorithm
    if lora is None:
        return
    if lora.rank < 1:
        raise ConfigError(f"model.lora.rank={lora.rank} must be >= 1 (--model.lora.rank=8)")
    if lora.alpha <= 0:
        raise ConfigError(f"model.lora.alpha={lora.alpha} must be > 0 (--model.lora.alpha=16)")
    if not 0 <= lora.dropout < 1:
        raise ConfigError(f"model.lora.dropout={lora.dropout} must be in [0, 1) (--model.lora.dropout)")
    bad = [t for t in lora.target_modules if t not in LORA_TARGETS]
    if bad or not lora.target_modules or len(set(lora.target_modules)) != len(lora.target_modules):
        raise ConfigError(f"model.lora.target_modules={lora.target_modules}: give each of {list(LORA_TARGETS)} "
                          "at most once, at least one (--model.lora.target_modules=linear_qkv,linear_proj)")
    for name, value, allowed in (("init", lora.init, LORA_INIT_NAMES), ("sync", lora.sync, LORA_SYNCS)):
        if value not in allowed:
            raise ConfigError(f"model.lora.{name}={value!r} is not one of {allowed} (--model.lora.{name})")
    if m.num_experts:
        # the reference view would replay the policy's routing, and expert linears are grouped
        raise ConfigError("model.lora is not supported for MoE models (model.num_experts="
                          f"{m.num_experts}) yet; train every parameter (--model.lora=null)")
    if m.transformer_impl == "transformer_engine" or m.fp8 != "none":
        # TE's qkv and fc1 fuse the input layer norm: the adapter would see the un-normed input
        raise ConfigError("model.lora adapts megatron's local-spec linears only; set "
                          "--model.transformer_impl=local (and --model.fp8=none)")
    if m.sequence_parallel:
        raise ConfigError("model.lora does not support model.sequence_parallel yet "
                          "(--model.sequence_parallel=false)")
    if a.ref_reset_every:
        # the reference is the frozen base (adapters off); resetting it means merging the
        # adapters into the base and restarting them, which the adapter-only checkpoint and
        # the engine's base copy (sync: adapter) would then have to follow
        raise ConfigError(f"algorithm.ref_reset_every={a.ref_reset_every}: with model.lora the reference is "
                          "the frozen base and is never reset (--algorithm.ref_reset_every=0)")
    if lora.sync == "adapter" and cfg.rollout.placement == "separate":
        # the separate engine processes have no adapter endpoint: the bridge would refuse
        # only after the model and engines were built
        raise ConfigError("model.lora.sync='adapter' needs colocated engines (rollout.placement="
                          "'separate' cannot load an adapter yet); use --model.lora.sync=merged "
                          "or --rollout.placement=colocated")
    if cfg.checkpoint.offload_reference or m.reference_fp8:
        raise ConfigError("with model.lora there is no reference model to offload or cast: the reference is "
                          "the actor with its adapters off (--checkpoint.offload_reference=false, "
                          "--model.reference_fp8=false)")
