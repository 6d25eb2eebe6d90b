"""The weight bridge: trainer (megatron, TP x PP x DP shards) -> rollout engines, verified.

What: after each optimizer step ``WeightBridge.sync()`` (collective over all
ranks) streams the trainer's weights into every rollout engine in place:
bucket by bucket from :func:`grpo_mega.bridge.export.export_buckets`, each
bucket handed at once to this rank's engine(s) through ``update_weights``;
after the last bucket ``reset_prefix_cache()`` (cached KV came from old
weights), then verification (``grpo_mega.bridge.verify``), then an all-reduced
verdict so that every rank raises ``WeightSyncError`` together instead of one
raising and the others hanging in the next collective.

A LoRA model (``model.lora``) syncs in one of two modes (``model.lora.sync``): ``merged``
sends W + scale * B A in place of each adapted weight, as above; ``adapter`` sends only the
adapter (full A and B in PEFT names) to engines serving base + adapter, and verifies the
update scale * B A they hold at random columns.

The bridge talks to engines only through ``grpo_mega.rollout.RolloutEngineProtocol``
and never imports vLLM; how a bucket reaches a vLLM worker (in-process tensors
or a /dev/shm file) and the tied-weight repack are the engine's business.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from grpo_mega.bridge.export import DEFAULT_BUCKET_BYTES, export_adapter_buckets, export_buckets, nbytes
from grpo_mega.bridge.lora import peft_config
from grpo_mega.bridge.verify import make_adapter_probes, make_probe, verify_adapter, verify_engine
from grpo_mega.config import ModelConfig
from grpo_mega.runtime.faults import fault_point
from grpo_mega.models import hf as mapping

__all__ = ["WeightBridge", "SyncStats", "WeightSyncError"]

log = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    """The rollout engine does not hold the trainer's weights after a sync."""


@dataclass
class SyncStats:
    """One sync, as seen by this rank."""

    seconds: float = 0.0
    export_seconds: float = 0.0
    """Gathering over TP, mapping, PP broadcasts (excluding the engine's own time)."""
    engine_seconds: float = 0.0
    """Inside the engines' update_weights and reset_prefix_cache."""
    verify_seconds: float = 0.0
    bytes: int = 0
    tensors: int = 0
    buckets: int = 0
    max_bucket_bytes: int = 0
    verified_tensors: int = 0

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["gbps"] = self.gbps
        return d


@dataclass
class WeightBridge:
    """Sync a megatron model's weights into rollout engines (see the module docstring).

    model: this rank's GPTModel stage. model_cfg: its ``ModelConfig`` (family picks
    the mapping table). ps: ``ParallelState``. engines: this rank's engines (a
    colocated engine on every rank, a child-process engine on one rank of each
    replica, or none); objects implementing ``grpo_mega.rollout.RolloutEngineProtocol``
    (only ``update_weights``, ``reset_prefix_cache`` and ``probe`` are called here;
    an engine with ``holds_engine`` False on this rank is skipped).
    """

    model: Any
    model_cfg: ModelConfig
    ps: Any
    engines: Sequence[Any] = ()
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """Target bucket size; peak extra memory is about one bucket plus one unit (a module,
    or one MoE layer's experts)."""
    verify: bool = True
    """Check the engines' weights after every sync (``--verify`` switch)."""
    verify_columns: int = 2
    """Columns (matrices) / rows (embeddings) probed per tensor and sync."""
    verify_atol: float = 0.0
    """Allowed |engine - trainer|; 0 means bitwise (after casting to the engine dtype)."""
    error_group: Any = None
    """Group over which a failed verification is agreed (None: the whole world)."""
    seed: int = 0
    lora_sync: Optional[str] = None
    """A LoRA model's sync (``model.lora.sync``): ``merged`` (W + scale * B A in place of
    each adapted weight, any engine) or ``adapter`` (the adapter alone, into an engine
    serving base + adapter: ``load_adapter`` / ``probe_adapter``). None: the config's."""
    syncs: int = field(default=0, init=False)

    def __post_init__(self):
        if not isinstance(self.engines, (list, tuple)):
            self.engines = [self.engines]
        self.engines = [e for e in self.engines if e is not None]
        for e in self.engines:
            missing = [m for m in ("update_weights", "reset_prefix_cache", "probe") if not hasattr(e, m)]
            if missing:
                raise TypeError(f"{type(e).__name__} does not implement the rollout engine protocol "
                                f"(grpo_mega.rollout.RolloutEngineProtocol): no {', '.join(missing)}")
        mapping.table(self.model_cfg.family)  # unknown family: fail before any collective
        lora_cfg = getattr(self.model_cfg, "lora", None)
        if self.lora_sync is None:
            self.lora_sync = lora_cfg.sync if lora_cfg is not None else None
        if self.lora_sync not in (None, "merged", "adapter"):
            raise ValueError(f"model.lora.sync={self.lora_sync!r}: choose 'merged' or 'adapter' "
                             "(--model.lora.sync)")
        if self.lora_sync == "adapter":
            if lora_cfg is None:
                raise ValueError("lora_sync='adapter' needs a LoRA model (model.lora)")
            for e in self.engines:
                if not all(hasattr(e, m) for m in ("load_adapter", "probe_adapter")):
                    raise TypeError(f"{type(e).__name__} cannot serve a LoRA adapter (no load_adapter / "
                                    "probe_adapter); use --model.lora.sync=merged with this engine")

    def _active_engines(self) -> list:
        return [e for e in self.engines if getattr(e, "holds_engine", True)]

    def sync(self, *, verify: Optional[bool] = None) -> SyncStats:
        """Push the current weights to the engines. Collective over all ranks."""
        verify = self.verify if verify is None else verify
        if self.lora_sync == "adapter":
            return self._sync_adapter(verify)
        engines = self._active_engines()
        stats, probes = SyncStats(), {}
        seed = hash((self.seed, self.syncs)) & 0x7FFFFFFF
        start = time.perf_counter()
        t = start
        for bucket in export_buckets(self.model, self.model_cfg, self.ps, bucket_bytes=self.bucket_bytes):
            stats.export_seconds += time.perf_counter() - t
            size = nbytes(bucket)
            stats.buckets += 1
            stats.tensors += len(bucket)
            stats.bytes += size
            stats.max_bucket_bytes = max(stats.max_bucket_bytes, size)
            t = time.perf_counter()
            for engine in engines:
                engine.update_weights(bucket)
            fault_point("bridge.sync", k=stats.buckets)  # the engine now holds mixed weights
            stats.engine_seconds += time.perf_counter() - t
            if verify and engines:
                for name, tensor in bucket:
                    probes[name] = make_probe(name, tensor, self.model_cfg, self.verify_columns, seed)
            del bucket
            t = time.perf_counter()
        t = time.perf_counter()
        for engine in engines:
            engine.reset_prefix_cache()
        stats.engine_seconds += time.perf_counter() - t
        self.syncs += 1
        if verify:
            self._verify(stats, engines, probes, verify_engine)
        stats.seconds = time.perf_counter() - start
        log.info("bridge: sync %d: %d tensors, %.1f MB in %d buckets, %.3f s (%.2f GB/s), verify %.3f s",
                 self.syncs, stats.tensors, stats.bytes / 1e6, stats.buckets, stats.seconds,
                 stats.gbps, stats.verify_seconds)
        return stats

    def _sync_adapter(self, verify: bool) -> SyncStats:
        """``lora_sync='adapter'``: the whole adapter (PEFT names, every stage's) into each
        engine in one load, then a prefix-cache reset (vLLM keys cached KV by the adapter's
        name and directory, and each load has a new directory, so this is belt and braces),
        then the adapter verification (``verify.make_adapter_probes``)."""
        engines = self._active_engines()
        stats = SyncStats()
        start = time.perf_counter()
        pairs = []
        for bucket in export_adapter_buckets(self.model, self.model_cfg, self.ps, bucket_bytes=self.bucket_bytes):
            stats.buckets += 1
            stats.max_bucket_bytes = max(stats.max_bucket_bytes, nbytes(bucket))
            pairs += bucket
        stats.tensors, stats.bytes = len(pairs), nbytes(pairs)
        stats.export_seconds = time.perf_counter() - start
        t = time.perf_counter()
        config = peft_config(self.model_cfg)
        for engine in engines:
            engine.load_adapter(pairs, config)
            engine.reset_prefix_cache()
        stats.engine_seconds = time.perf_counter() - t
        seed = hash((self.seed, self.syncs)) & 0x7FFFFFFF
        self.syncs += 1
        if verify:
            probes = make_adapter_probes(pairs, self.model_cfg.lora, self.verify_columns, seed)
            self._verify(stats, engines, probes, verify_adapter)
        stats.seconds = time.perf_counter() - start
        log.info("bridge: adapter sync %d: %d tensors, %.2f MB, %.3f s, verify %.3f s",
                 self.syncs, stats.tensors, stats.bytes / 1e6, stats.seconds, stats.verify_seconds)
        return stats

    def _verify(self, stats: SyncStats, engines: list, probes: dict, check) -> None:
        """Every engine's readings against ``probes`` (``check``: ``verify_engine``, or
        ``verify_adapter`` for the adapter sync); the verdict agreed over the ranks."""
        t = time.perf_counter()
        problems = [p for engine in engines for p in check(engine, probes, self.verify_atol)]
        stats.verified_tensors = len(probes) if engines else 0
        self._agree(problems)
        stats.verify_seconds = time.perf_counter() - t

    def _agree(self, problems: list[str]) -> None:
        """Raise WeightSyncError on every rank if verification failed on any."""
        failed = torch.tensor([1.0 if problems else 0.0])
        if dist.is_available() and dist.is_initialized():
            failed = failed.to(self.ps.device)
            dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self.error_group)
        if problems:
            shown = "; ".join(problems[:8]) + (f"; ... ({len(problems)} in all)" if len(problems) > 8 else "")
            raise WeightSyncError(f"weight sync {self.syncs} did not apply on rank {self.ps.rank}: {shown}")
        if float(failed) > 0:
            raise WeightSyncError(f"weight sync {self.syncs} did not apply on another rank "
                                  "(see that rank's error)")
