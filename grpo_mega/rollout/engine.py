"""The vLLM rollout engine: one engine per data-parallel replica of the trainer.

What: :class:`RolloutEngine` wraps ``vllm.LLM`` and implements
:class:`~grpo_mega.rollout.types.RolloutEngineProtocol`. ``generate`` returns a
:class:`RolloutBatch` (prompt ids, response ids, the sampled tokens' logprobs
under the sampling distribution, finish reasons, lengths), group-major: sample
``g * n + j`` is the j-th response to prompt g. ``update_weights`` loads new
weights in place (HF names) through the worker extension
(``grpo_mega.rollout.worker``), ``probe`` reads them back for the weight
bridge, ``release``/``resume`` free accelerator memory while training when the
engine is colocated (on CPU they are recorded no-ops).

Layout: every rank draws the same global prompt batch;
:meth:`RolloutEngine.generate_for_replica` takes this replica's contiguous
slice (``data.shard_for_replica``) and every rank of the replica gets the
replica's outputs. The trainer places replicas on blocks of ``rollout.tp``
consecutive ranks (``rollout.layout.engine_block``), independent of its own
TP x PP x DP, and :meth:`RolloutEngine.generate_resharded` hands each trainer
DP replica its share of the samples. Three engine modes:

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
    never a disk checkpoint), read by the worker extension inside the child.
    Slower to start; the script's work must sit under
    ``if __name__ == "__main__":`` because the child re-imports ``__main__``.
``inprocess``
    ``uni`` executor in this process, no child. Only for a job of one
    process: with a torch.distributed world > 1 already initialised it
    HANGS (vLLM reuses the default process group and waits for ranks that
    never join), so it is refused there.

``mode="auto"`` picks ``inprocess`` for a single process, and inside a
torch.distributed world ``external_launcher`` when every replica is a block of
consecutive ranks (always so for the trainer's ``engine_block`` groups), else
``child``.

CPU (no GPU): dtype float32, eager mode, a small ``max_model_len``, ``VLLM_CPU_KVCACHE_SPACE``
and ``HF_HUB_OFFLINE`` are set automatically. vLLM's CPU worker replaces
``torch.set_num_threads`` in the process that hosts it: set threads before.

Logprobs: vLLM's default ``raw_logprobs`` are computed before temperature.
When the engine's sampling uses temperature != 1 (or top-p/top-k) the engine
is built with ``logprobs_mode="processed_logprobs"``: the log-probabilities
of the distribution actually sampled from (after temperature, and after
top-k/top-p truncation and renormalisation). A trainer that recomputes them
must apply the same transforms.
"""
from __future__ import annotations

import collections
import gc
import logging
import os
import sys
import time
from typing import Any, Iterable, Mapping, Sequence

import torch

from grpo_mega.data import shard_for_replica
from grpo_mega.rollout.lora_adapter import AdapterMixin, lora_engine_kwargs
from grpo_mega.rollout.samples import (check_budgets, request_seed as _request_seed,
                                       sampled_logprobs as _sampled_logprobs)
from grpo_mega.rollout.sleep import SleepPhases
from grpo_mega.rollout.torch_modes import outside_torch_function_modes
from grpo_mega.rollout.types import EngineConfig, RolloutBatch, SamplingConfig, logprobs_mode_for, model_runner_env
from grpo_mega.rollout.worker import clear_dead_weight_files, write_weight_file

__all__ = ["RolloutEngine", "resolve_engine_mode"]

log = logging.getLogger(__name__)


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
        return "inprocess" if world == 1 else "external_launcher" if consecutive_replicas else "child"
    if mode == "inprocess" and world > 1:
        raise RuntimeError(
            f"rollout engine_mode='inprocess' inside a torch.distributed world of {world} ranks "
            "hangs (vLLM reuses the default process group); use 'external_launcher' or 'child'")
    return mode


def child_visible_devices(visible: str | None, index: int) -> str:
    """CUDA_VISIBLE_DEVICES for a child engine on this process's device ``index`` (an index
    into ``visible``, the parent's CUDA_VISIBLE_DEVICES, or a physical id without it)."""
    if not visible:
        return str(index)
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if index >= len(ids):
        raise ValueError(f"device {index} is not in CUDA_VISIBLE_DEVICES={visible!r}: set "
                         "LOCAL_RANK / the visible devices so every rank has its own GPU")
    return ids[index]


class RolloutEngine(AdapterMixin, SleepPhases):
    """A vLLM engine for one data-parallel replica of the trainer; implements
    :class:`~grpo_mega.rollout.types.RolloutEngineProtocol`.

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
        self._transport: str | None = None
        self.releases = self.resumes = 0
        self.memory_released = False
        self._asleep: set[str] = set()  # "weights", "kv_cache": what vLLM's sleep freed
        self._weights_stale = False  # True from a level-2 release until the next load
        self._update_open = False  # a reload is open in the worker (update_weights)
        # The engine's last calls in order ("generate", "load", "release", "resume"): the
        # order of the step's memory phases is visible, and tested, on CPU too.
        self.calls: collections.deque[str] = collections.deque(maxlen=256)
        self.llm = None
        self.startup_seconds = 0.0
        self.shm_job_id: str | None = None
        """The id in this engine's /dev/shm segment names (CPU, TP >= 2), else None."""
        # vLLM's CPU worker replaces torch.set_num_threads in its process;
        # shutdown() puts the original back.
        self._set_num_threads = torch.set_num_threads
        if self.on_cpu and self.mode == "external_launcher" and len(self._replica_ranks) > 1:
            # vLLM's CPU TP engines share memory through /dev/shm segments whose names are
            # the same for every job on the machine; a killed job's leftovers made every
            # later engine fail at start (errno 17). See rollout/cpu_shm.py.
            from grpo_mega.rollout import cpu_shm
            cpu_shm.clear_stale_segments()
            self.shm_job_id = cpu_shm.agreed_job_id()
            cpu_shm.job_scoped_names(self.shm_job_id)
        if self.mode == "child" and self.holds_engine and os.path.isdir(engine.shm_dir):
            clear_dead_weight_files(engine.shm_dir)  # a killed job's transport files
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
        return self.mode != "child" or _dist_world()[0] == self.replica_leader

    @property
    def replica_leader(self) -> int:
        """Global rank of this replica's first rank (multi-turn environments run there)."""
        return self._replica_ranks[0]

    @property
    def lockstep(self) -> bool:
        """Whether the replicas must call ``generate`` together (vLLM's data-parallel launcher)."""
        return self.mode == "external_launcher" and self.dp_size > 1

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
        kwargs.update(lora_engine_kwargs(cfg.lora_rank), **cfg.extra)
        return kwargs

    def _engine_env(self) -> dict[str, str]:
        env = {"HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
               # Read once at construction: 0 keeps the engine core in this
               # process, 1 puts it in a child process.
               "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if self.mode == "child" else "0",
               **model_runner_env(self.config.model_runner)}  # rollout.model_runner
        if not self.on_cpu and self.mode == "child":
            # vLLM's uni executor in the child always takes cuda:0, and the child does not
            # inherit this process's set_device(LOCAL_RANK): show it only this rank's GPU.
            env["CUDA_VISIBLE_DEVICES"] = child_visible_devices(
                os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.current_device())
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

            # vLLM's start runs several full garbage collections (model load, KV-cache profiling,
            # freeze_gc_heap), each walking every object our imports and models made: frozen,
            # they are skipped (a two-step CPU run: 0.93x the CPU s, bench_startup.py). Refcounts
            # still free them; shutdown() unfreezes (cyclic garbage lives as long as the engine).
            gc.freeze()
            with outside_torch_function_modes():
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
        with outside_torch_function_modes():
            self.llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], params, use_tqdm=False)

    # -- generation ------------------------------------------------------
    def _sampling_params(self, s: SamplingConfig, seed: int | None, max_tokens: int | None = None):
        if s.transforms_logits and self.logprobs_mode == "raw_logprobs":
            raise ValueError(
                f"sampling with temperature={s.temperature}, top_p={s.top_p}, top_k={s.top_k} "
                "on an engine built with raw logprobs would return logprobs of a different "
                "distribution; build the engine with that sampling config (or "
                "logprobs_mode='processed_logprobs')")
        from vllm import SamplingParams

        return SamplingParams(
            n=s.n, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k if s.top_k > 0 else 0,
            max_tokens=max_tokens or s.max_new_tokens, min_tokens=min(s.min_new_tokens, max_tokens or s.max_new_tokens),
            stop=list(s.stop) or None,
            stop_token_ids=list(s.stop_token_ids) or None, ignore_eos=s.ignore_eos,
            seed=seed, logprobs=0, detokenize=True, flat_logprobs=True)

    def generate(self, prompts: Sequence[Any], sampling: SamplingConfig | None = None, *,
                 step: int | None = None, prompt_offset: int = 0, progress: bool = False,
                 keys: Sequence[int] | None = None, budgets: Sequence[int] | None = None) -> RolloutBatch:
        """Sample ``n`` responses for each prompt (token id lists or objects
        with ``token_ids``, e.g. ``data.Prompt``). Collective over the replica
        (and over the world for ``external_launcher``); every rank of the
        replica returns the same batch. ``step`` feeds the per-request seeds
        (default: an internal counter). ``progress``: vLLM's progress bar, when stderr is a
        terminal (evaluation uses it). ``keys``: each request's seed index (default
        ``prompt_offset + i``; multi-turn episodes pass their own, so an episode keeps its
        random stream whichever others are still running). ``budgets``: each request's
        ``max_new_tokens`` (default: the sampling's)."""
        s = sampling or self.sampling
        step = self._step if step is None else step
        self._step = step + 1
        self.calls.append("generate")
        batch = None
        if self.holds_engine:
            batch = self._generate_local(prompts, s, step, prompt_offset,
                                         progress and sys.stderr.isatty(), keys, budgets)
        if self.mode == "child" and len(self._replica_ranks) > 1:
            batch = self._broadcast(batch)
        return batch

    def generate_for_replica(self, global_prompts: Sequence[Any], sampling: SamplingConfig | None = None,
                             *, step: int | None = None, progress: bool = False) -> RolloutBatch:
        """Generate for this replica's slice of the global batch (the same on
        every rank); ``prompt_index`` refers to the global batch."""
        if len(global_prompts) % self.dp_size:
            raise ValueError(f"global batch of {len(global_prompts)} prompts does not split over "
                             f"{self.dp_size} replicas; make the prompt batch a multiple of dp size")
        mine = shard_for_replica(global_prompts, self.dp_rank, self.dp_size)
        offset = self.dp_rank * (len(global_prompts) // self.dp_size)
        return self.generate(mine, sampling, step=step, prompt_offset=offset, progress=progress)

    def generate_resharded(self, global_prompts: Sequence[Any], sampling: SamplingConfig | None = None,
                           *, step: int | None = None, to_rank: int = 0, to_size: int = 1,
                           progress: bool = False, mini_batches: int = 1) -> RolloutBatch:
        """The samples of slice ``to_rank`` of ``to_size`` of the global prompt batch (a
        trainer DP replica's share), whatever the engine layout: each engine replica samples
        its own slice, the slices are gathered on every rank and cut anew
        (``rollout.layout``; ``mini_batches``: see ``prompt_slice``). Collective over the world."""
        from grpo_mega.rollout.layout import gather_global, prompt_slice

        mine = self.generate_for_replica(global_prompts, sampling, step=step, progress=progress)
        if _dist_world()[1] == 1:
            return prompt_slice(mine, len(global_prompts), to_rank, to_size, mini_batches)
        everything = gather_global(mine, contributes=_dist_world()[0] == self._replica_ranks[0])
        return prompt_slice(everything, len(global_prompts), to_rank, to_size, mini_batches)

    def _generate_local(self, prompts: Sequence[Any], s: SamplingConfig, step: int,
                        offset: int, use_tqdm: bool = False, keys: Sequence[int] | None = None,
                        budgets: Sequence[int] | None = None) -> RolloutBatch:
        from vllm.inputs import TokensPrompt

        self._finish_update()
        ids = [list(getattr(p, "token_ids", p)) for p in prompts]
        max_len = self.llm.llm_engine.model_config.max_model_len
        budgets = [s.max_new_tokens] * len(ids) if budgets is None else list(budgets)
        check_budgets(ids, budgets, max_len, offset, s.max_new_tokens)
        requests = [TokensPrompt(prompt_token_ids=p) for p in ids]
        keys = [offset + i for i in range(len(ids))] if keys is None else list(keys)
        params = [self._sampling_params(s, _request_seed(s.seed, step, keys[i], s.n), budgets[i])
                  for i in range(len(ids))]
        start = time.perf_counter()
        with outside_torch_function_modes():
            outputs = self.llm.generate(requests, params, use_tqdm=use_tqdm,
                                        lora_request=self.lora_request) if requests else []
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

    # -- weights (RolloutEngineProtocol) --------------------------------
    @property
    def weight_transport(self) -> str:
        """How ``update_weights`` reaches the worker: ``tensors`` (engine in this
        process) or ``file`` (engine core in a child process: /dev/shm)."""
        return self._transport or ("file" if self.mode == "child" else "tensors")

    @weight_transport.setter
    def weight_transport(self, value: str) -> None:
        if value not in ("tensors", "file"):
            raise ValueError(f"weight_transport={value!r}; choose 'tensors' or 'file'")
        self._transport = value

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
                       ) -> float:
        """Load weights in place, by HF name; returns the seconds it took.

        Call it on every rank of the replica; ranks that hold no engine
        (child mode, except the replica's first rank) ignore the tensors, so
        the bridge may pass an empty iterable there. A partial update
        (a bucket) must cover whole fused layers: q, k and v together, gate
        and up together (updating q alone silently corrupts outputs), and all
        experts of an MoE layer together (a part is refused: ValueError). The buckets
        of one update form one vLLM reload (one pass over the model, not one per
        bucket), closed by :meth:`reset_prefix_cache` after the last bucket (or by the
        next generate / probe / release), which also repacks tied modules.
        """
        self.calls.append("load")
        if not self.holds_engine:
            return 0.0
        if "weights" in self._asleep:
            raise RuntimeError("rollout: weights loaded into a sleeping engine; call wake_weights() first")
        self._weights_stale = False
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        start = time.perf_counter()
        tensors = [(name, t.detach()) for name, t in items]
        self._update_open = True  # the worker's reload stays open until _finish_update
        if self.weight_transport == "file":
            with write_weight_file(tensors, self.config.shm_dir) as path:
                self.llm.collective_rpc("grpo_mega_update_from_file", args=(path, False))
        else:
            self.llm.collective_rpc("grpo_mega_update", args=(tensors, False))
        seconds = time.perf_counter() - start
        log.info("rollout: updated %d tensors in %.3f s (%s)", len(tensors), seconds, self.weight_transport)
        return seconds

    def reset_prefix_cache(self) -> None:
        """End an update (:meth:`update_weights`); drop cached KV (the old weights made it)."""
        if self.holds_engine:
            self._finish_update()
            self.llm.reset_prefix_cache()

    def _finish_update(self) -> None:
        """Close the worker's open reload: until then layers not yet loaded sit on the
        meta device, so nothing may run the model."""
        if self._update_open:
            self._update_open = False
            self.llm.collective_rpc("grpo_mega_finish_update")

    def probe(self, specs: Sequence[Any]) -> list[dict]:
        """The weight bridge's verification reads, one dict per vLLM worker
        (see ``worker.probe_weights``); [] on a rank holding no engine."""
        if not self.holds_engine:
            return []
        self._finish_update()
        return self.llm.collective_rpc("grpo_mega_probe", args=(list(specs),))

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
            gc.unfreeze()  # what _build_llm froze (vLLM's in-process teardown does it too)
        self.drop_adapter_dir()
        torch.set_num_threads = self._set_num_threads

    close = shutdown
