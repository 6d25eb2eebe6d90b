"""Rollouts with vLLM's offline engine: n samples per prompt, with logprobs.

What: :class:`RolloutEngine` wraps ``vllm.LLM``. ``generate`` returns a
:class:`RolloutBatch` (prompt ids, response ids, the sampled tokens'
logprobs under the sampling distribution, finish reasons, lengths), group-
major: sample ``g * n + j`` is the j-th response to prompt g.
``update_weights`` loads new weights in place (HF names), for the weight
bridge. ``sleep``/``wake_up`` free accelerator memory while training when the
engine is colocated; on CPU they are logged no-ops.

Layout: one engine per data-parallel replica of the trainer. Every rank draws
the same global prompt batch; :meth:`RolloutEngine.generate_for_replica`
takes this replica's contiguous slice (``data.shard_for_replica``) and every
rank of the replica gets the replica's outputs. Three engine modes:

``external_launcher`` (use this under torchrun when it fits)
    Every rank of the job builds the engine inside its own process (vLLM's
    SPMD "external launcher"); vLLM's tensor-parallel group is the trainer's
    replica (``tensor_parallel_size = replica size``) and its data-parallel
    size the number of replicas, so together they cover the world, which
    vLLM requires. vLLM's ranks are laid out DP-outer / TP-inner, so the
    replica must be a block of consecutive ranks (megatron's default order
    with PP=1). Each rank gets its replica's outputs directly, and weights
    are passed as in-process tensors (vLLM slices its own TP shard). Fast
    to start; every ``generate`` call is collective over the world.
``child``
    The replica's first rank builds a default multiprocess engine (engine
    core in a child process, ``uni`` executor there) and broadcasts the
    outputs over the replica group. Works with any trainer layout. Weights
    travel through a safetensors file in ``/dev/shm`` (never pickled lists,
    never a disk checkpoint), read by a worker extension inside the child.
    Slower to start; the script's work must sit under
    ``if __name__ == "__main__":`` because the child re-imports ``__main__``.
``inprocess``
    ``uni`` executor in this process, no child. Only for a job of one
    process: with a torch.distributed world > 1 already initialised it
    HANGS (vLLM reuses the default process group and waits for ranks that
    never join), so it is refused there.

``mode="auto"`` picks ``inprocess`` for a single process, and inside a
torch.distributed world ``external_launcher`` when every replica is a block of
consecutive ranks, else ``child``.

CPU (no GPU): dtype float32, eager mode, a small ``max_model_len``,
``VLLM_CPU_KVCACHE_SPACE`` and ``HF_HUB_OFFLINE`` are set automatically.
Note that vLLM's CPU worker replaces ``torch.set_num_threads`` in the process
that hosts it (``inprocess``/``external_launcher``): set threads before.

Logprobs: vLLM's default ``raw_logprobs`` are computed before temperature.
When the engine's sampling uses temperature != 1 (or top-p/top-k) the engine
is built with ``logprobs_mode="processed_logprobs"``: the log-probabilities
of the distribution actually sampled from (after temperature, and after
top-k/top-p truncation and renormalisation). A trainer that recomputes them
must apply the same transforms.

How to run (tests; they skip without vllm)::

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/rollout/test_engine.py
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch

from grpo_mega.data import shard_for_replica

__all__ = [
    "ENGINE_MODES", "SamplingConfig", "EngineConfig", "RolloutBatch", "RolloutEngine",
    "WorkerExtension", "resolve_engine_mode", "logprobs_mode_for",
]

log = logging.getLogger(__name__)
ENGINE_MODES = ("auto", "external_launcher", "child", "inprocess")


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
    """None: True on CPU (torch.compile stretched startup from ~5 s to ~67 s)."""
    colocate: bool = False
    """Enable sleep mode so ``sleep()`` frees GPU memory while training.
    Unsupported on CPU: sleep/wake are then logged no-ops."""
    kv_cache_space_gib: int = 1
    """CPU only: KV cache size (VLLM_CPU_KVCACHE_SPACE); unset, vLLM took 14.75 GiB."""
    seed: int = 0
    """Engine seed; must be equal on all ranks of an external_launcher engine."""
    logprobs_mode: str | None = None
    """None: from the engine's sampling (see ``logprobs_mode_for``)."""
    shm_dir: str = "/dev/shm"
    """child mode: where the weight file of an update is written (RAM-backed)."""
    worker_extension_cls: str = "grpo_mega.rollout.WorkerExtension"
    """Class mixed into vLLM's worker, by qualified name. A replacement must
    derive from :class:`WorkerExtension` (child mode reads weight files with
    its ``grpo_mega_reload_from_file``)."""
    warmup: bool = True
    """Run one tiny request with logprobs at startup (the first such request
    is slow), so the first training step is timed fairly."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Further ``vllm.LLM`` keyword arguments, passed unchanged."""

    def __post_init__(self) -> None:
        if self.mode not in ENGINE_MODES:
            raise ValueError(f"rollout engine_mode={self.mode!r}; choose one of {ENGINE_MODES}")


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
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RolloutBatch":
        return cls(**d)

    def to_tensors(self, pad_id: int) -> dict[str, torch.Tensor]:
        """Right-padded prompt+response sequences for the trainer.

        Returns (B = len(self), T = longest prompt+response):
          tokens:           [B, T] long, pad_id after the end
          response_mask:    [B, T] bool, True on response tokens
          rollout_logprobs: [B, T] float32, logprob of tokens[b, t] at response
                            positions (0 elsewhere) - i.e. aligned with the
                            token, predicted by the logits at t - 1
          prompt_lengths, response_lengths: [B] long
        """
        lengths = [len(p) + len(r) for p, r in zip(self.prompt_ids, self.response_ids)]
        b, t = len(self), max(lengths, default=0)
        tokens = torch.full((b, t), pad_id, dtype=torch.long)
        mask = torch.zeros((b, t), dtype=torch.bool)
        lps = torch.zeros((b, t), dtype=torch.float32)
        for i, (p, r, lp) in enumerate(zip(self.prompt_ids, self.response_ids, self.logprobs)):
            tokens[i, :len(p) + len(r)] = torch.tensor(list(p) + list(r), dtype=torch.long)
            mask[i, len(p):len(p) + len(r)] = True
            lps[i, len(p):len(p) + len(r)] = torch.tensor(lp, dtype=torch.float32)
        return {"tokens": tokens, "response_mask": mask, "rollout_logprobs": lps,
                "prompt_lengths": torch.tensor(self.prompt_lengths, dtype=torch.long),
                "response_lengths": torch.tensor(self.response_lengths, dtype=torch.long)}


# ---------------------------------------------------------------------------
# Worker side of weight updates (runs inside vLLM's worker, any process)
# ---------------------------------------------------------------------------

class WorkerExtension:
    """Mixed into vLLM's worker via ``worker_extension_cls``, so a child-
    process engine can be told, by name, to read weights from a file."""

    def grpo_mega_reload_from_file(self, path: str) -> int:
        from safetensors.torch import load_file

        tensors = load_file(path, device="cpu")
        # reload_weights takes HF names and redoes vLLM's packing (qkv,
        # gate_up, CPU prepacking); model.load_weights on the live model
        # fails on CPU because prepacked weights were replaced at load.
        self.reload_weights(weights_iterator=list(tensors.items()))  # type: ignore[attr-defined]
        return len(tensors)

    def grpo_mega_call(self, target: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``module:function(worker, *args, **kwargs)`` inside the worker.

        A child-process engine only runs worker methods by name unless
        VLLM_ALLOW_INSECURE_SERIALIZATION=1 lets it unpickle callables; this
        gives any importable function (e.g. the bridge's weight probe) the
        same reach: ``llm.collective_rpc("grpo_mega_call", args=(target, ...))``.
        """
        import importlib

        module, _, name = target.partition(":")
        return getattr(importlib.import_module(module), name)(self, *args, **kwargs)


# ---------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------

def _dist_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def resolve_engine_mode(mode: str, consecutive_replicas: bool = True) -> str:
    """``auto`` -> ``inprocess`` alone; in a world > 1 ``external_launcher``
    when replicas are blocks of consecutive ranks, else ``child``."""
    _, world = _dist_world()
    if mode == "auto":
        if world == 1:
            return "inprocess"
        return "external_launcher" if consecutive_replicas else "child"
    if mode == "inprocess" and world > 1:
        raise RuntimeError(
            f"rollout engine_mode='inprocess' inside a torch.distributed world of {world} ranks "
            "hangs (vLLM reuses the default process group); use 'external_launcher' or 'child'")
    return mode


def _request_seed(base: int | None, step: int, prompt_index: int, n: int) -> int | None:
    """Per-prompt seed from (base, step, index); vLLM adds 0..n-1 per sample."""
    if base is None:
        return None
    digest = hashlib.sha256(f"{base}:{step}:{prompt_index}".encode()).digest()
    return int.from_bytes(digest[:4], "little") % (2**31 - n)  # seed + j stays an int32


class RolloutEngine:
    """A vLLM engine for one data-parallel replica of the trainer.

    Args:
        engine: how to build vLLM (:class:`EngineConfig`).
        sampling: default sampling (its temperature picks the logprobs mode).
        replica_group: the trainer's process group of this replica (the ranks
            that share one copy of the model, e.g. megatron's model-parallel
            group); None for a single process. Every rank of the world must
            construct the engine (collective in ``external_launcher`` mode).
        dp_rank, dp_size: this replica's index and the number of replicas.
    """

    def __init__(self, engine: EngineConfig, sampling: SamplingConfig | None = None, *,
                 replica_group: Any = None, dp_rank: int = 0, dp_size: int = 1):
        self.config = engine
        self.sampling = sampling or SamplingConfig()
        self.replica_group = replica_group
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.on_cpu = not torch.cuda.is_available()
        self.logprobs_mode = engine.logprobs_mode or logprobs_mode_for(self.sampling)
        self._replica_ranks = self._replica_layout()
        self.mode = resolve_engine_mode(engine.mode, self._consecutive_replica())
        if self.mode == "external_launcher" and not self._consecutive_replica():
            raise ValueError(
                f"external_launcher needs each replica to be consecutive ranks (vLLM lays out DP "
                f"outer, TP inner): replica {self.dp_rank} is {self._replica_ranks}; use rollout "
                "engine_mode='child' (or 'auto') for this layout")
        self._step = 0
        self.llm = None
        self.startup_seconds = 0.0
        # vLLM's CPU worker replaces torch.set_num_threads in its process;
        # shutdown() puts the original back.
        self._set_num_threads = torch.set_num_threads
        if self.holds_engine:
            start = time.perf_counter()
            self.llm = self._build_llm()
            if engine.warmup:
                self._warmup()
            self.startup_seconds = time.perf_counter() - start
            log.info("rollout: vLLM engine (%s) up in %.1f s", self.mode, self.startup_seconds)

    # -- construction ----------------------------------------------------
    def _replica_layout(self) -> list[int]:
        import torch.distributed as dist

        _, world = _dist_world()
        if world == 1:
            if self.dp_size != 1:
                raise ValueError(f"dp_size={self.dp_size} without a torch.distributed world")
            return [0]
        if self.replica_group is None:
            raise ValueError("inside a torch.distributed world, pass replica_group (the ranks "
                             "of this data-parallel replica)")
        ranks = sorted(dist.get_process_group_ranks(self.replica_group))
        if len(ranks) * self.dp_size != world:
            raise ValueError(f"replica of {len(ranks)} ranks x dp_size={self.dp_size} != world {world}")
        if not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"dp_rank={self.dp_rank} not in [0, {self.dp_size})")
        return ranks

    def _consecutive_replica(self) -> bool:
        """Replica r is ranks [r*size, (r+1)*size): vLLM's external_launcher
        layout (megatron's default order gives it when PP == 1 or DP == 1)."""
        size = len(self._replica_ranks)
        return self._replica_ranks == list(range(self.dp_rank * size, (self.dp_rank + 1) * size))

    @property
    def holds_engine(self) -> bool:
        """Whether this rank hosts (part of) an engine."""
        if self.mode == "child":
            return _dist_world()[0] == self._replica_ranks[0]
        return True

    def _llm_kwargs(self) -> dict[str, Any]:
        cfg = self.config
        kwargs: dict[str, Any] = dict(
            model=cfg.model,
            tokenizer=cfg.tokenizer or cfg.model,
            seed=cfg.seed,
            logprobs_mode=self.logprobs_mode,
            worker_extension_cls=cfg.worker_extension_cls,
        )
        if self.on_cpu:
            kwargs.update(dtype=cfg.dtype or "float32",
                          enforce_eager=True if cfg.enforce_eager is None else cfg.enforce_eager,
                          max_model_len=cfg.max_model_len or 1024)
        else:
            # (On CPU vLLM reads gpu_memory_utilization as a fraction of RAM
            # to reserve; the explicit KV cache size replaces it there.)
            kwargs.update(dtype=cfg.dtype or "auto", enable_sleep_mode=cfg.colocate,
                          gpu_memory_utilization=cfg.gpu_memory_utilization)
            if cfg.enforce_eager is not None:
                kwargs["enforce_eager"] = cfg.enforce_eager
            if cfg.max_model_len is not None:
                kwargs["max_model_len"] = cfg.max_model_len
        if self.mode == "external_launcher":
            kwargs.update(distributed_executor_backend="external_launcher",
                          tensor_parallel_size=len(self._replica_ranks))
            if self.dp_size > 1:
                kwargs["data_parallel_size"] = self.dp_size
        else:
            kwargs.update(distributed_executor_backend="uni", tensor_parallel_size=1)
        kwargs.update(cfg.extra)
        return kwargs

    def _engine_env(self) -> dict[str, str]:
        env = {"HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
               # Read once at construction: 0 keeps the engine core in this
               # process, 1 puts it in a child process.
               "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if self.mode == "child" else "0"}
        if self.on_cpu:
            env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get(
                "VLLM_CPU_KVCACHE_SPACE", str(max(1, int(self.config.kv_cache_space_gib))))
        return env

    def _build_llm(self):
        # The variables are set only while vLLM starts (a child engine inherits
        # them), then restored: left behind, VLLM_ENABLE_V1_MULTIPROCESSING=0
        # would turn a later engine in this process, or in processes it
        # spawns, into an in-process one (which hangs inside a world > 1).
        env = self._engine_env()
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            from vllm import LLM

            return LLM(**self._llm_kwargs())
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def _warmup(self) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=2, logprobs=0, temperature=1.0, seed=0)
        self.llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], params, use_tqdm=False)

    # -- generation ------------------------------------------------------
    def _sampling_params(self, s: SamplingConfig, seed: int | None):
        if s.transforms_logits and self.logprobs_mode == "raw_logprobs":
            raise ValueError(
                f"sampling with temperature={s.temperature}, top_p={s.top_p}, top_k={s.top_k} "
                "on an engine built with raw logprobs would return logprobs of a different "
                "distribution; build the engine with that sampling config (or "
                "logprobs_mode='processed_logprobs')")
        from vllm import SamplingParams

        return SamplingParams(
            n=s.n, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k if s.top_k > 0 else 0,
            max_tokens=s.max_new_tokens, min_tokens=s.min_new_tokens, stop=list(s.stop) or None,
            stop_token_ids=list(s.stop_token_ids) or None, ignore_eos=s.ignore_eos,
            seed=seed, logprobs=0, detokenize=True)

    def generate(self, prompts: Sequence[Any], sampling: SamplingConfig | None = None, *,
                 step: int | None = None, prompt_offset: int = 0) -> RolloutBatch:
        """Sample ``n`` responses for each prompt (token id lists or objects
        with ``token_ids``, e.g. ``data.Prompt``). Collective over the replica
        (and over the world for ``external_launcher``); every rank of the
        replica returns the same batch. ``step`` feeds the per-request seeds
        (default: an internal counter)."""
        s = sampling or self.sampling
        step = self._step if step is None else step
        self._step = step + 1
        batch = None
        if self.holds_engine:
            batch = self._generate_local(prompts, s, step, prompt_offset)
        if self.mode == "child" and len(self._replica_ranks) > 1:
            batch = self._broadcast(batch)
        return batch

    def generate_for_replica(self, global_prompts: Sequence[Any], sampling: SamplingConfig | None = None,
                             *, step: int | None = None) -> RolloutBatch:
        """Generate for this replica's slice of the global batch (the same on
        every rank); ``prompt_index`` refers to the global batch."""
        if len(global_prompts) % self.dp_size:
            raise ValueError(f"global batch of {len(global_prompts)} prompts does not split over "
                             f"{self.dp_size} replicas; make the prompt batch a multiple of dp size")
        mine = shard_for_replica(global_prompts, self.dp_rank, self.dp_size)
        offset = self.dp_rank * (len(global_prompts) // self.dp_size)
        return self.generate(mine, sampling, step=step, prompt_offset=offset)

    def _generate_local(self, prompts: Sequence[Any], s: SamplingConfig, step: int,
                        offset: int) -> RolloutBatch:
        from vllm.inputs import TokensPrompt

        ids = [list(getattr(p, "token_ids", p)) for p in prompts]
        max_len = self.llm.llm_engine.model_config.max_model_len
        for i, p in enumerate(ids):
            if not p:
                raise ValueError(f"prompt {offset + i} is empty")
            if len(p) + s.max_new_tokens > max_len:
                # vLLM would reject it mid-batch or cut the response short.
                raise ValueError(f"prompt {offset + i} has {len(p)} tokens; with max_new_tokens="
                                 f"{s.max_new_tokens} it exceeds the engine's max_model_len={max_len} "
                                 "(raise rollout max_model_len or lower data max_prompt_tokens)")
        requests = [TokensPrompt(prompt_token_ids=p) for p in ids]
        params = [self._sampling_params(s, _request_seed(s.seed, step, offset + i, s.n))
                  for i in range(len(ids))]
        start = time.perf_counter()
        outputs = self.llm.generate(requests, params, use_tqdm=False) if requests else []
        seconds = time.perf_counter() - start
        batch = RolloutBatch(prompt_ids=[], response_ids=[], logprobs=[], finish_reasons=[],
                             prompt_index=[], group_size=s.n, logprobs_mode=self.logprobs_mode,
                             seconds=seconds)
        for i, out in enumerate(outputs):
            completions = sorted(out.outputs, key=lambda c: c.index)
            if len(completions) != s.n:
                raise RuntimeError(f"vLLM returned {len(completions)} samples for prompt {i}, "
                                   f"expected n={s.n}")
            for c in completions:
                batch.prompt_ids.append(list(ids[i]))
                batch.response_ids.append(list(c.token_ids))
                batch.logprobs.append(_sampled_logprobs(c))
                batch.finish_reasons.append(str(c.finish_reason))
                batch.stop_reasons.append(c.stop_reason)
                batch.texts.append(c.text)
                batch.prompt_index.append(offset + i)
        return batch

    def _broadcast(self, batch: RolloutBatch | None) -> RolloutBatch:
        import torch.distributed as dist

        box = [batch.to_dict() if batch is not None else None]
        dist.broadcast_object_list(box, src=self._replica_ranks[0], group=self.replica_group)
        return RolloutBatch.from_dict(box[0])

    # -- weights ---------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
                       ) -> float:
        """Load weights in place, by HF name; returns the seconds it took.

        Call it on every rank of the replica; ranks that hold no engine
        (child mode, except the replica's first rank) ignore the tensors, so
        the bridge may pass an empty iterable there. A partial update
        (a bucket) must cover whole fused layers: q, k and v together, gate
        and up together (updating q alone silently corrupts outputs). The
        prefix cache is reset afterwards (cached KV came from old weights).
        """
        if not self.holds_engine:
            return 0.0
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        start = time.perf_counter()
        tensors = self._with_tied_lm_head([(name, t.detach()) for name, t in items])
        if self.mode == "child":
            self._update_through_file(tensors)
        else:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": tensors})
        count = len(tensors)
        self.llm.reset_prefix_cache()
        seconds = time.perf_counter() - start
        log.info("rollout: updated %d tensors in %.3f s (%s)", count, seconds, self.mode)
        return seconds

    def _with_tied_lm_head(self, tensors: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Add ``lm_head.weight`` when embeddings are tied and only the
        embedding is sent. Measured on CPU (Qwen2 and Llama): without it the
        LM head keeps its prepacked copy of the OLD embedding and the logits
        are wrong (off by ~5 nats), silently."""
        names = {name for name, _ in tensors}
        if self._tied and "model.embed_tokens.weight" in names and "lm_head.weight" not in names:
            embed = next(t for name, t in tensors if name == "model.embed_tokens.weight")
            tensors = [*tensors, ("lm_head.weight", embed)]
        return tensors

    @property
    def _tied(self) -> bool:
        if not hasattr(self, "_tied_cache"):
            cfg_path = Path(self.config.model) / "config.json"
            cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
            self._tied_cache = bool(cfg.get("tie_word_embeddings", False))
        return self._tied_cache

    def _update_through_file(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        from safetensors.torch import save_file

        tensors: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, t in items:
            t = t.to("cpu").contiguous()
            # safetensors refuses tensors that share memory (the tied head).
            if t.untyped_storage().data_ptr() in seen:
                t = t.clone()
            seen.add(t.untyped_storage().data_ptr())
            tensors[name] = t
        need = sum(t.numel() * t.element_size() for t in tensors.values())
        shm = Path(self.config.shm_dir)
        free = os.statvfs(shm).f_bavail * os.statvfs(shm).f_frsize
        if need * 1.05 > free:
            raise RuntimeError(f"weight update needs {need / 2**30:.2f} GiB in {shm} but only "
                               f"{free / 2**30:.2f} GiB are free; send smaller buckets or enlarge "
                               "/dev/shm (docker: --shm-size)")
        fd, path = tempfile.mkstemp(prefix="grpo_mega_weights_", suffix=".safetensors", dir=shm)
        os.close(fd)
        try:
            save_file(tensors, path)
            self.llm.collective_rpc("grpo_mega_reload_from_file", args=(path,))
        finally:
            os.unlink(path)

    # -- memory ----------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Free accelerator memory while the trainer runs (colocate=True)."""
        if self._sleep_unsupported("sleep"):
            return
        self.llm.sleep(level=level)

    def wake_up(self) -> None:
        if self._sleep_unsupported("wake_up"):
            return
        self.llm.wake_up()

    def _sleep_unsupported(self, what: str) -> bool:
        if not self.holds_engine:
            return True
        if self.on_cpu:
            log.info("rollout: %s skipped: vLLM has no sleep mode on CPU", what)
            return True
        if not self.config.colocate:
            log.info("rollout: %s skipped: engine built with colocate=False", what)
            return True
        return False

    def release(self) -> None:
        """Free the engine's memory between phases (stub; the rollout rework implements it)."""

    def resume(self) -> None:
        """Take the engine's memory back before it is used (stub; the rollout rework implements it)."""

    def shutdown(self) -> None:
        """Drop the engine (its child process, in child mode).

        In ``external_launcher``/``inprocess`` mode vLLM's teardown also
        destroys torch.distributed's DEFAULT process group (vLLM's
        ``cleanup_dist_env_and_memory``): call it after the trainer's last
        collective, or not at all.
        """
        if self.llm is not None:
            engine = getattr(self.llm, "llm_engine", None)
            core = getattr(engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
            self.llm = None
        torch.set_num_threads = self._set_num_threads


def _sampled_logprobs(completion) -> list[float]:
    """The logprob of each sampled token (``SamplingParams(logprobs=0)``
    returns exactly the sampled token's entry per position)."""
    lps = completion.logprobs
    if lps is None or len(lps) != len(completion.token_ids):
        raise RuntimeError("vLLM returned no per-token logprobs for a sample")
    return [float(lps[t][tok].logprob) for t, tok in enumerate(completion.token_ids)]
