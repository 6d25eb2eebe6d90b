"""Rollout data types and the engine protocol the trainer and the weight bridge use.

What: the sampling and engine configurations, :class:`RolloutBatch` (the
samples of one generate call, group-major) and :class:`RolloutEngineProtocol`,
the only surface through which the weight bridge talks to an engine. Kept
free of vLLM so the bridge, the trainer and non-vLLM engines (tests) can use
it without importing vLLM.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Iterable, Mapping, Protocol, Sequence, runtime_checkable

import torch

__all__ = [
    "ENGINE_MODES", "SamplingConfig", "EngineConfig", "RolloutBatch", "RolloutEngineProtocol",
    "ProbeSpec", "logprobs_mode_for",
]

ENGINE_MODES = ("auto", "external_launcher", "child", "inprocess")
# rollout.model_runner -> VLLM_USE_V2_MODEL_RUNNER while the engine starts (None: unset, vLLM
# chooses). vLLM 0.26.0 reads it in VllmConfig.use_v2_model_runner and, unset, runs V2 for
# dense models on GPU; the CPU build runs V1 (no Triton CPU backend).
MODEL_RUNNERS = {"v1": "0", "v2": "1", "auto": None}


def model_runner_env(model_runner: str) -> dict[str, str]:
    """The environment that selects ``model_runner`` (see MODEL_RUNNERS) in vLLM."""
    value = MODEL_RUNNERS[model_runner]
    return {} if value is None else {"VLLM_USE_V2_MODEL_RUNNER": value}


@dataclass(frozen=True)
class SamplingConfig:
    """How responses are sampled (one set per engine, overridable per call)."""

    n: int = 1
    """Responses per prompt (the GRPO group size)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 (or -1) disables top-k."""
    max_new_tokens: int = 256
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    """Stop strings; the response ends after the token that completes one."""
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    """Base seed. Each request's seed is derived from (seed, step, prompt
    index), so a run is reproducible and a resumed run passing the same
    ``step`` draws the same samples. ``None``: unseeded."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"rollout n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"rollout temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"rollout max_new_tokens must be >= 1, got {self.max_new_tokens}")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def transforms_logits(self) -> bool:
        """Whether sampling draws from something other than the plain softmax
        of the logits. Greedy (temperature 0) does not count: it draws from
        nothing, and its reported logprobs are the plain softmax's."""
        if self.temperature == 0:
            return False
        return self.temperature != 1.0 or self.top_p < 1.0 or self.top_k > 0


def logprobs_mode_for(sampling: SamplingConfig) -> str:
    return "processed_logprobs" if sampling.transforms_logits else "raw_logprobs"


@dataclass(frozen=True)
class EngineConfig:
    """How the vLLM engine is built. ``None`` means "chosen for the device"."""

    model: str
    """HF checkpoint directory (config.json + safetensors + tokenizer)."""
    tokenizer: str | None = None
    """Tokenizer directory; defaults to ``model``."""
    mode: str = "auto"
    """One of ENGINE_MODES; see the module docstring."""
    dtype: str | None = None
    """None: float32 on CPU, "auto" (the checkpoint's) on GPU."""
    max_model_len: int | None = None
    """Prompt + response tokens; None: 1024 on CPU, the model's on GPU."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may take (weights + KV cache). Ignored on CPU."""
    enforce_eager: bool | None = None
    """None: True on CPU (torch.compile stretched startup from ~5 s to ~67 s), vLLM's
    default (False: compiled, CUDA graphs) on GPU."""
    model_runner: str = "v1"
    """One of MODEL_RUNNERS: vLLM's model runner (``rollout.model_runner``)."""
    colocate: bool = False
    """Enable vLLM's sleep mode so ``release()`` frees GPU memory while
    training. Unsupported on CPU: release/resume are then recorded no-ops."""
    kv_cache_space_gib: int = 1
    """CPU only: KV cache size (VLLM_CPU_KVCACHE_SPACE); unset, vLLM took 14.75 GiB."""
    seed: int = 0
    """Engine seed; must be equal on all ranks of an external_launcher engine."""
    logprobs_mode: str | None = None
    """None: from the engine's sampling (see ``logprobs_mode_for``)."""
    shm_dir: str = "/dev/shm"
    """child mode: where the weight file of an update is written (RAM-backed)."""
    worker_extension_cls: str = "grpo_mega.rollout.worker.WorkerExtension"
    """Class mixed into vLLM's worker, by qualified name. A replacement must
    derive from :class:`grpo_mega.rollout.worker.WorkerExtension`: weight
    updates and probes call its methods by name."""
    warmup: bool = True
    """Run one tiny request with logprobs at startup (the first such request
    is slow), so the first training step is timed fairly."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Further ``vllm.LLM`` keyword arguments, passed unchanged."""
    lora_rank: int = 0
    """> 0: the engine serves the base plus one LoRA adapter of up to this rank, loaded by
    ``load_adapter`` (``model.lora.sync: adapter``; ``rollout.lora_adapter``). 0: none."""

    def __post_init__(self) -> None:
        if self.mode not in ENGINE_MODES:
            raise ValueError(f"rollout engine_mode={self.mode!r}; choose one of {ENGINE_MODES}")
        if self.model_runner not in MODEL_RUNNERS:
            raise ValueError(f"rollout.model_runner={self.model_runner!r}; choose one of "
                             f"{tuple(MODEL_RUNNERS)} (--rollout.model_runner)")


# ---------------------------------------------------------------------------
# The batch
# ---------------------------------------------------------------------------

@dataclass
class RolloutBatch:
    """Samples of one generate call, group-major (``len == num_prompts * n``)."""

    prompt_ids: list[list[int]]
    """Per sample (each prompt's ids repeated for its n samples)."""
    response_ids: list[list[int]]
    logprobs: list[list[float]]
    """Per response token: its log-probability under the sampling distribution."""
    finish_reasons: list[str]
    """"stop" (eos, stop token or stop string) or "length" (hit max_new_tokens)."""
    prompt_index: list[int]
    """Index of each sample's prompt in the batch passed to generate (the
    global batch for ``generate_for_replica``)."""
    group_size: int
    texts: list[str] = field(default_factory=list)
    """vLLM's decoded response text (stop string excluded)."""
    stop_reasons: list[Any] = field(default_factory=list)
    """The stop string or stop token id that ended a sample, else None."""
    response_mask: list[list[int]] = field(default_factory=list)
    """Multi-turn episodes: per response token, 1 where the model sampled it and 0 where the
    environment's reply (tool output, chat-template separators) was appended; its logprob
    is then 0.0 and the loss never reads it. Empty for single-turn batches (all sampled)."""
    episode_rewards: list[float] = field(default_factory=list)
    """Multi-turn episodes: the environment's reward (the sum over turns). Empty otherwise."""
    episode_info: list[dict] = field(default_factory=list)
    """Multi-turn episodes: JSON-able facts per episode (turns, tool calls, token-exact
    problems) for metrics. Empty otherwise."""
    versions: list[list[int]] = field(default_factory=list)
    """Asynchronous GRPO: per response token, the policy version that sampled it (the trainer
    step whose weights the engine held then: one version per step's weight sync, whatever the
    epochs and mini-batches inside the step); a weight update in flight mixes two
    versions in one response. Empty when every token has the engine's one version."""
    logprobs_mode: str = "raw_logprobs"
    seconds: float = 0.0

    def __len__(self) -> int:
        return len(self.response_ids)

    @property
    def response_lengths(self) -> list[int]:
        return [len(r) for r in self.response_ids]

    @property
    def prompt_lengths(self) -> list[int]:
        return [len(p) for p in self.prompt_ids]

    @property
    def num_response_tokens(self) -> int:
        return sum(self.response_lengths)

    def to_dict(self) -> dict[str, Any]:
        """The fields, sharing this batch's lists (one level, no deep copy: ``asdict`` copied
        every token list of every sample and cost about 3% of the rollout stage)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def select(self, prompts: Iterable[int]) -> "RolloutBatch":
        """The samples of the given global prompt indices, in batch order (the same batch
        when that is all of them; the per-sample lists are otherwise new, their items shared)."""
        keep = set(prompts)
        idx = [i for i, p in enumerate(self.prompt_index) if p in keep]
        return self.take(idx)

    def take(self, samples: Sequence[int]) -> "RolloutBatch":
        """The samples at the given positions, in that order (the same batch when that is all
        of them, in order; the per-sample lists are otherwise new, their items shared)."""
        idx = list(samples)
        if idx == list(range(len(self))):
            return self
        per_sample = {k: [getattr(self, k)[i] for i in idx] if getattr(self, k) else []
                      for k in _PER_SAMPLE}
        return replace(self, **per_sample)

    @classmethod
    def concat(cls, batches: Sequence["RolloutBatch"]) -> "RolloutBatch":
        """One batch of several (same group size and logprobs mode); ``seconds`` is the
        slowest part's, as the parts run side by side."""
        if not batches:
            raise ValueError("concat of no rollout batches")
        first = batches[0]
        for b in batches:
            if (b.group_size, b.logprobs_mode) != (first.group_size, first.logprobs_mode):
                raise ValueError("concat of rollout batches with different group sizes or logprobs modes")
        joined = {k: [x for b in batches for x in getattr(b, k)] for k in _PER_SAMPLE}
        return replace(first, **joined, seconds=max(b.seconds for b in batches))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RolloutBatch":
        return cls(**d)


_PER_SAMPLE = ("prompt_ids", "response_ids", "logprobs", "finish_reasons", "prompt_index", "texts",
               "stop_reasons", "response_mask", "episode_rewards", "episode_info", "versions")
"""The ``RolloutBatch`` fields with one entry per sample."""

ProbeSpec = tuple  # (hf_name, rows: list[int] | None, cols: list[int] | None)


@runtime_checkable
class RolloutEngineProtocol(Protocol):
    """What the trainer and the weight bridge call on a rollout engine.

    Weight updates come in buckets of whole fused layers (q, k, v together;
    gate and up together): an engine may repack a fused layer as soon as a
    bucket arrives. Ranks that host no engine accept and ignore every call.
    The trainer (``trainer/stages.py``) uses ``sampling``, ``dp_size`` and
    ``generate_resharded``; the bridge uses the weight methods and ``probe``.
    """

    sampling: SamplingConfig
    """The engine's default sampling; the trainer derives each round's sampling from it."""
    dp_size: int
    """Number of engine replicas in the job (evaluation splits its prompts over them)."""
    dp_rank: int
    """This rank's engine replica."""
    replica_group: Any
    """The process group of this rank's engine replica (None for a single process)."""
    replica_leader: int
    """Global rank of the replica's first rank: multi-turn environments run there."""
    lockstep: bool
    """Whether the replicas must call ``generate`` together (multi-turn turns then are)."""

    def generate(self, prompts: Sequence[Any], sampling: Any = None, *,
                 step: int | None = None, keys: Sequence[int] | None = None,
                 budgets: Sequence[int] | None = None) -> RolloutBatch:
        """Sample ``n`` responses per prompt (token id lists or objects with ``token_ids``);
        ``keys``: per-request seed indices, ``budgets``: per-request max_new_tokens
        (multi-turn episodes pass both)."""
        ...

    def generate_resharded(self, global_prompts: Sequence[Any], sampling: Any = None, *,
                           step: int | None = None, to_rank: int = 0, to_size: int = 1,
                           progress: bool = False, mini_batches: int = 1) -> RolloutBatch:
        """The samples of share ``to_rank`` of ``to_size`` of the global prompt batch (one
        trainer DP replica's share of each of the step's ``mini_batches`` blocks of prompts,
        ``rollout.layout.prompt_slice``), whatever the engine layout. Collective over the world."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Any:
        """Load HF-named full tensors in place (one bucket). Tensors may be
        views the caller reuses: copy what must outlive the call."""
        ...

    def reset_prefix_cache(self) -> None:
        """End the update (the buckets since the last call form one: the vLLM engine loads
        them as one reload) and drop cached KV (computed with the old weights); call after
        the last bucket."""
        ...

    def probe(self, specs: Sequence[ProbeSpec]) -> list[dict]:
        """Read back slices of the held weights, one result per worker:
        ``{"dtype": str, "probes": {hf_name: [reading, ...]}}`` where a reading is
        ``{"values", "rows", "cols", "via"}`` or ``{"error"}``; see
        ``grpo_mega.rollout.worker.probe_weights`` for the exact semantics."""
        ...

    def release(self) -> None:
        """Free accelerator memory for the training phase (vLLM sleep)."""
        ...

    def resume(self) -> None:
        """Take the memory back before the next rollout (vLLM wake_up)."""
        ...

    def wake_weights(self) -> None:
        """After the update: map the weights' memory back, for the sync to fill (a no-op
        where nothing sleeps)."""
        ...

    def wake_kv_cache(self) -> None:
        """After the sync: map the KV cache back (a no-op where nothing sleeps)."""
        ...


class AdapterRolloutEngineProtocol(RolloutEngineProtocol, Protocol):
    """What ``model.lora.sync: adapter`` also calls: the engine serves its base plus one LoRA
    adapter (``rollout.lora_adapter``); the bridge checks an engine has both at start-up."""

    def load_adapter(self, pairs: Sequence[tuple[str, torch.Tensor]], config: dict) -> float:
        """Serve base + this adapter (PEFT names and ``adapter_config.json`` fields) from now
        on; returns the seconds it took."""
        ...

    def probe_adapter(self, specs: Sequence[tuple[str, list[int]]]) -> list[dict]:
        """Columns of scale * B A of the served adapter, per HF module, one dict per worker
        (the bridge's verification)."""
        ...


class AsyncRolloutEngineProtocol(RolloutEngineProtocol, Protocol):
    """What asynchronous GRPO (``rollout.placement: separate``) also calls, on global rank 0
    (``grpo_mega.rollout.remote.RemoteEngines``; the other ranks' stand-in ignores it)."""

    next_version: int | None
    """The policy version the next weight update gives the engines' tokens (the trainer
    step); None: the current version + 1."""

    def submit(self, prompts: Sequence[Any], sampling: Any = None, *, step: int,
               keys: Sequence[int] | None = None) -> Any:
        """Queue ``n`` samples per prompt and return at once; a ticket for ``collect``."""
        ...

    def collect(self, ticket: Any, timeout_s: float | None = None) -> RolloutBatch:
        """The ticket's samples, group-major, with per-token ``versions``; raises naming the
        engine if one died or did not answer in time."""
        ...
