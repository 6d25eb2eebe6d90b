"""Weight bridge: trainer (megatron, TP x PP x DP shards) -> rollout engines (vLLM, HF names).

What: after each optimizer step ``WeightBridge.sync()`` streams the trainer's
weights into every rollout engine in place, bucket by bucket, then resets the
engines' prefix caches and (by default) verifies that the engines hold exactly
the trainer's weights. A sync that did not apply raises ``WeightSyncError``.

How the weights travel (all ranks of the world call ``sync()`` together):

1. Each pipeline stage walks its own parameters, grouped by megatron module, with
   global layer indices. Per tensor, the TP shards are all-gathered into the
   canonical full tensor (``mcore_layout.gather``: grouped QKV, [gate; up] fc1
   halves, vocabulary padding removed) and turned into HF tensors by the family's
   mapping table (``mapping.canonical_to_hf``). The tied output layer is skipped
   (the embedding is exported once, from stage 0).
2. HF tensors are packed into buckets of about ``bucket_bytes``. A module is never
   split over two buckets: vLLM reprocesses a fused layer (qkv_proj = q, k, v
   weights and biases; gate_up_proj) only once all its tensors arrived, and a
   partial update silently corrupts it.
3. With PP > 1 every engine needs every stage's weights, so stages take turns:
   stage s broadcasts its buckets over the PP group one at a time (a name/shape
   header, then the tensors). No rank ever holds more than about one bucket plus
   one module's gathered tensors; nobody gathers the whole model.
4. Each bucket goes to this rank's engine(s) at once (``update_weights``), or for an
   engine in another process through a safetensors file in /dev/shm
   (``update_weights_from_file``): never a checkpoint on disk, never pickled lists.
   Inside the worker, vLLM's ``reload_weights`` repacks what it received; modules
   that share a received weight are then repacked too (on CPU a tied lm_head keeps
   its own prepacked copy of the embedding, which plain ``reload_weights`` leaves
   stale: new embedding, old logits).
5. After the last bucket: ``reset_prefix_cache()`` (cached KV came from old
   weights), then verification (below), then an all-reduced verdict so that every
   rank raises together instead of hanging in the next collective.

Verification reads the engine's weights back. vLLM's CPU linear layers drop their
weight after prepacking it, so a weight is probed through the layer's own
kernel: multiplying by a few one-hot rows returns exact columns of W (checked
bitwise on CPU; TF32 is switched off for the probe on GPU). Every tensor sent is
checked: k random columns of each matrix (fresh ones each sync), k random rows of
the embedding / lm_head read directly *and* through every kernel that uses them (a
tied lm_head included), all of every norm weight and bias. The cost is about a
k-token forward pass (~0.1 s for a 100M model on 2 CPU cores). vLLM's fused names
(qkv_proj, gate_up_proj) and its TP sharding are resolved inside the worker
(``probe_worker_weights``).

Engine protocol (what the bridge calls on the objects passed as ``engines``):

    update_weights(named_tensors: list[tuple[str, Tensor]])   # in-process engine; in the
                                       # worker: bridge.reload_worker_weights (reload + repack)
    update_weights_from_file(path: str)                      # engine in another process
    reset_prefix_cache()
    probe_weights(specs: list[tuple[str, list[int] | None, list[int] | None]]) -> list[dict]
                                       # verification: collective_rpc of
                                       # bridge.probe_worker_weights, one dict per worker
    weight_transport: "tensors" | "file"  (optional attribute; default "tensors")
    holds_engine: bool                     (optional attribute; default True)

``VLLMEngine`` adapts a ``vllm.LLM`` (``BridgeWorkerExtension`` gives a child-process
engine the worker functions by name). ``as_sync_engine`` also accepts an object that
has ``update_weights`` plus an ``llm`` attribute (``rollout.RolloutEngine``; its child
mode reaches the worker functions through ``grpo_mega_call``).

    bridge = WeightBridge(model, cfg.model, ps, [VLLMEngine(llm)])
    stats = bridge.sync()            # collective over all ranks; raises WeightSyncError

Tests: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/bridge/test_sync.py``.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from grpo_mega.models import hf as mapping

from grpo_mega.models import layout as mcore_layout
from grpo_mega.config import ModelConfig

__all__ = [
    "WeightSyncError", "WeightBridge", "SyncStats", "VLLMEngine", "BridgeWorkerExtension",
    "as_sync_engine", "export_buckets", "export_hf_weights", "probe_worker_weights",
    "reload_worker_weights_from_file", "write_safetensors", "DEFAULT_BUCKET_BYTES",
]

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 256 * 2**20
Bucket = list  # list[tuple[str, torch.Tensor]]: HF name, full tensor


class WeightSyncError(RuntimeError):
    """The rollout engine does not hold the trainer's weights after a sync."""


# =============================================================================== export

def _unwrap(model):
    # megatron's DDP / Float16Module wrappers keep the GPTModel in .module
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def _stage_modules(model, cfg: ModelConfig, ps) -> list[list[tuple[str, torch.Tensor]]]:
    """This stage's parameters as [(canonical name, local tensor)] per megatron module,
    in model order. The last stage's tied copy of the embedding is left out."""
    per = cfg.num_layers // ps.pp
    groups: dict[str, list] = {}
    for local_name, p in _unwrap(model).named_parameters():
        name = mcore_layout.to_global_name(local_name, ps.pp_rank, per)
        if name == "output_layer.weight" and cfg.tie_embeddings:
            continue
        groups.setdefault(mapping.module_of(name), []).append((name, p.detach()))
    return list(groups.values())


def _gather_module(params, cfg: ModelConfig, ps) -> list[tuple[str, torch.Tensor]]:
    """TP all-gather each tensor of one module and map it to HF tensors (every TP rank
    gets them: a colocated engine needs the full tensors on every rank)."""
    out = []
    for name, local in params:
        full = mcore_layout.gather(name, local, ps.tp_group, ps.tp, cfg.vocab_size)
        out += mapping.canonical_to_hf(name, full, cfg)
    return out


def _nbytes(pairs) -> int:
    return sum(t.numel() * t.element_size() for _, t in pairs)


def _stage_buckets(model, cfg: ModelConfig, ps, bucket_bytes: int) -> Iterator[Bucket]:
    """This stage's HF tensors in buckets of about ``bucket_bytes`` (whole modules only)."""
    bucket, size = [], 0
    for params in _stage_modules(model, cfg, ps):
        pairs = _gather_module(params, cfg, ps)
        n = _nbytes(pairs)
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket += pairs
        size += n
    if bucket:
        yield bucket


_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64,
                               torch.int8, torch.uint8, torch.int32, torch.int64)}


def _broadcast_bucket(bucket: Optional[Bucket], src: int, group) -> None:
    header = None if bucket is None else [(n, tuple(t.shape), str(t.dtype)) for n, t in bucket]
    dist.broadcast_object_list([header], src=src, group=group)
    for _, t in bucket or ():
        dist.broadcast(t.contiguous(), src=src, group=group)


def _receive_bucket(src: int, group, device) -> Optional[Bucket]:
    box = [None]
    dist.broadcast_object_list(box, src=src, group=group)
    if box[0] is None:
        return None
    bucket = []
    for name, shape, dtype in box[0]:
        t = torch.empty(shape, dtype=_DTYPES[dtype], device=device)
        dist.broadcast(t, src=src, group=group)
        bucket.append((name, t))
    return bucket


def export_buckets(model, model_cfg: ModelConfig, ps, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                   all_stages: bool = True) -> Iterator[Bucket]:
    """Yield the model's HF tensors as buckets ``[(hf_name, full tensor), ...]``.

    Collective: every rank of the TP and PP groups must exhaust the generator.
    ``all_stages=True``: every rank receives every stage's buckets (stage 0's first),
    broadcast over the PP group one bucket at a time. ``False``: each stage yields
    only its own. Tensors may be views; do not modify them.
    """
    if ps.pp == 1 or not all_stages:
        yield from _stage_buckets(model, model_cfg, ps, bucket_bytes)
        return
    for stage in range(ps.pp):
        src = dist.get_global_rank(ps.pp_group, stage)
        if ps.pp_rank == stage:
            for bucket in _stage_buckets(model, model_cfg, ps, bucket_bytes):
                _broadcast_bucket(bucket, src, ps.pp_group)
                yield bucket
            _broadcast_bucket(None, src, ps.pp_group)  # end of this stage
        else:
            while (bucket := _receive_bucket(src, ps.pp_group, ps.device)) is not None:
                yield bucket


def export_hf_weights(model, model_cfg: ModelConfig, ps, *,
                      bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for the whole model on every rank; same rules as ``export_buckets``."""
    for bucket in export_buckets(model, model_cfg, ps, bucket_bytes=bucket_bytes):
        yield from bucket


# =============================================================================== transport

_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
              torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.int8: "I8",
              torch.uint8: "U8"}


def write_safetensors(path: str, pairs: Sequence[tuple[str, torch.Tensor]],
                      metadata: Optional[dict] = None) -> int:
    """Write ``pairs`` as one safetensors file without first copying them into a dict
    (views that share storage are fine, unlike ``safetensors.torch.save_file``).
    Returns the bytes written. Layout: u64 header length, JSON header, raw data."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, t in pairs:
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, t in pairs:
            t = t.detach().to("cpu").contiguous()
            if t.numel():
                f.write(memoryview(t.view(torch.uint8).reshape(-1).numpy()))
    return offset


def reload_worker_weights(worker, named_tensors) -> int:
    """Runs inside a vLLM worker: reload HF-named tensors in place.

    ``reload_weights`` takes HF names and redoes vLLM's packing (qkv / gate_up
    fusion, CPU prepacking); ``model.load_weights`` on the live model fails on CPU.
    Then modules that share a weight with a reloaded one are repacked: on CPU a tied
    lm_head keeps its own prepacked copy of the embedding, which ``reload_weights``
    does not refresh (the lm_head received no tensor), so it would keep producing
    logits from the old weights while the embedding is new."""
    named_tensors = list(named_tensors)
    worker.reload_weights(weights_iterator=named_tensors)
    _repack_shared_weights(_worker_model(worker), [n for n, _ in named_tensors])
    return len(named_tensors)


def reload_worker_weights_from_file(worker, path: str) -> int:
    """Runs inside a vLLM worker: ``reload_worker_weights`` from a safetensors file."""
    from safetensors import safe_open

    with safe_open(path, framework="pt", device="cpu") as f:
        tensors = [(k, f.get_tensor(k)) for k in f.keys()]
    return reload_worker_weights(worker, tensors)


def _worker_model(worker):
    runner = worker.model_runner
    return runner.get_model() if hasattr(runner, "get_model") else runner.model


def _sharing_modules(model, with_names: bool = False) -> list:
    """Groups of modules whose ``weight`` is one shared Parameter (tied embeddings);
    with_names: groups of (qualified name, module)."""
    owners: dict[int, list] = {}
    for name, m in model.named_modules():
        w = m._parameters.get("weight") if hasattr(m, "_parameters") else None
        if w is not None and w.numel() and hasattr(m, "quant_method"):
            owners.setdefault(id(w), []).append((name, m) if with_names else m)
    return [mods for mods in owners.values() if len(mods) > 1]


def repack_worker_shared_weights(worker, loaded: Optional[Sequence[str]] = None) -> int:
    """Runs inside a vLLM worker: repack tied weights after a plain ``reload_weights``
    (see ``reload_worker_weights``). Returns the number of modules repacked."""
    return _repack_shared_weights(_worker_model(worker), loaded)


def _repack_shared_weights(model, loaded: Optional[Sequence[str]] = None) -> int:
    """Repack the modules of a sharing group that did not receive the weight themselves
    when another module of the group did (``loaded``: the HF names just reloaded, which
    vLLM has repacked already; None: repack every shared module). Packing a large
    embedding costs ~0.1 s on CPU, so nothing else is touched."""
    n = 0
    loaded = None if loaded is None else set(loaded)
    with torch.no_grad():
        for group in _sharing_modules(model, with_names=True):
            got = [loaded is None or f"{name}.weight" in loaded for name, _ in group]
            if not any(got):
                continue
            for (_, m), fresh in zip(group, got):
                if loaded is None or not fresh:
                    m.quant_method.process_weights_after_loading(m)
                    n += 1
    return n


class BridgeWorkerExtension:
    """vLLM ``worker_extension_cls`` giving a child-process engine the bridge's worker
    functions by name (callables need VLLM_ALLOW_INSECURE_SERIALIZATION there).

        LLM(..., worker_extension_cls="grpo_mega.bridge.BridgeWorkerExtension")
    """

    def grpo_bridge_reload(self, named_tensors) -> int:
        return reload_worker_weights(self, named_tensors)

    def grpo_bridge_reload_from_file(self, path: str) -> int:
        return reload_worker_weights_from_file(self, path)

    def grpo_bridge_probe(self, specs) -> dict:
        return probe_worker_weights(self, specs)


class VLLMEngine:
    """The bridge's engine protocol over a ``vllm.LLM``.

    transport: ``tensors`` (engine in this process: inprocess / external_launcher)
    or ``file`` (engine core in a child process: buckets go through /dev/shm).
    worker_extension: call worker functions by name (engine built with
    ``worker_extension_cls=grpo_mega.bridge.BridgeWorkerExtension``) instead of
    sending callables.
    """

    def __init__(self, llm, *, transport: str = "tensors", worker_extension: Optional[bool] = None):
        if transport not in ("tensors", "file"):
            raise ValueError(f"transport={transport!r}; choose 'tensors' or 'file'")
        self.llm = llm
        self.weight_transport = transport
        self.worker_extension = (transport == "file") if worker_extension is None else worker_extension

    def update_weights(self, named_tensors) -> None:
        fn = "grpo_bridge_reload" if self.worker_extension else reload_worker_weights
        self.llm.collective_rpc(fn, args=(list(named_tensors),))

    def update_weights_from_file(self, path: str) -> None:
        fn = "grpo_bridge_reload_from_file" if self.worker_extension else reload_worker_weights_from_file
        self.llm.collective_rpc(fn, args=(path,))

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def probe_weights(self, specs) -> list[dict]:
        fn = "grpo_bridge_probe" if self.worker_extension else probe_worker_weights
        return self.llm.collective_rpc(fn, args=(specs,))


class _LLMHolder:
    """Adapter for an object with ``update_weights`` and a ``vllm.LLM`` in ``.llm``
    (``rollout.RolloutEngine``): its own update path, the LLM for the rest. A child-
    process engine runs the bridge's worker functions through the worker's by-name
    ``grpo_mega_call(target, *args)`` hook (rollout.WorkerExtension)."""

    def __init__(self, engine):
        self.engine = engine
        self.weight_transport = "tensors"

    @property
    def holds_engine(self) -> bool:
        return bool(getattr(self.engine, "holds_engine", True)) and self.engine.llm is not None

    def _call(self, fn, *args):
        llm = self.engine.llm
        if getattr(self.engine, "mode", None) != "child":
            return llm.collective_rpc(fn, args=args)
        try:
            return llm.collective_rpc("grpo_mega_call", args=(f"{fn.__module__}:{fn.__name__}",) + args)
        except NotImplementedError as e:
            raise WeightSyncError(
                "a child-process engine runs bridge functions only through its worker's "
                "grpo_mega_call hook (rollout.WorkerExtension) or grpo_mega.bridge."
                "BridgeWorkerExtension; this engine's worker_extension_cls has neither "
                "(or turn verification off: rollout.verify_sync=false)") from e

    def update_weights(self, named_tensors) -> None:
        named_tensors = list(named_tensors)
        self.engine.update_weights(named_tensors)
        # tied lm_head on CPU, see reload_worker_weights
        self._call(repack_worker_shared_weights, [n for n, _ in named_tensors])

    def reset_prefix_cache(self) -> None:
        self.engine.llm.reset_prefix_cache()

    def probe_weights(self, specs) -> list[dict]:
        return self._call(probe_worker_weights, specs)


def as_sync_engine(engine):
    """Accept a protocol object, a ``vllm.LLM`` (-> ``VLLMEngine``) or an object with
    ``update_weights`` and ``.llm`` (-> adapter)."""
    if hasattr(engine, "reset_prefix_cache") and (hasattr(engine, "update_weights")
                                                  or hasattr(engine, "update_weights_from_file")):
        return engine
    if hasattr(engine, "collective_rpc") and hasattr(engine, "reset_prefix_cache"):
        return VLLMEngine(engine)  # a vllm.LLM in this process
    if hasattr(engine, "update_weights") and hasattr(engine, "llm"):
        return _LLMHolder(engine)
    raise TypeError(f"{type(engine).__name__} does not implement the bridge's engine protocol "
                    "(update_weights or update_weights_from_file, and reset_prefix_cache)")


# =============================================================================== verification

@dataclass
class _Probe:
    """What the engine must hold for one HF tensor W.

    expected = W[rows][:, cols] with None meaning every row / column (global order).
    Matrices: rows None, cols k random columns. Embedding / lm_head: rows k random
    vocabulary rows (all columns) and ``kernel_cols`` k hidden columns at which the
    output-projection kernel is probed. 1-D tensors: everything.
    """

    rows: Optional[list[int]]
    cols: Optional[list[int]]
    expected: torch.Tensor
    kernel_cols: Optional[list[int]] = None

    def spec(self, name: str) -> tuple:
        return (name, self.rows, self.cols if self.rows is None else self.kernel_cols)


def _make_probe(name: str, t: torch.Tensor, cfg: ModelConfig, k: int, seed: int) -> _Probe:
    if t.ndim == 1:
        return _Probe(None, None, t.detach().to("cpu", copy=True))
    # Columns depend on the sync and the input width only, so q, k and v (gate and up)
    # share them and the worker runs each fused kernel once.
    gen = torch.Generator().manual_seed(seed ^ t.shape[1])
    cols = sorted(torch.randperm(t.shape[1], generator=gen)[:k].tolist())
    if mapping.is_vocab_hf_name(name, cfg):
        gen = torch.Generator().manual_seed(seed ^ zlib.crc32(name.encode()))
        rows = sorted(torch.randperm(t.shape[0], generator=gen)[:k].tolist())
        return _Probe(rows, None, t[rows].detach().to("cpu"), kernel_cols=cols)
    return _Probe(None, cols, t[:, cols].detach().to("cpu"))


def _positions(held: Optional[list[int]], want: Optional[list[int]]):
    """Index into an expected axis (``want``: its global indices, None = all) of the
    global indices ``held`` (None = all of them)."""
    if held is None:
        return slice(None)
    if want is None:
        return list(held)
    return [want.index(i) for i in held]


def _compare(name: str, probe: _Probe, reading: dict, engine_dtype: torch.dtype, atol: float
             ) -> Optional[str]:
    """None if one reading of the engine matches, else a short description."""
    if "error" in reading:
        return f"{name}: {reading['error']}"
    exp = probe.expected.to(engine_dtype).float()
    exp = exp[_positions(reading.get("rows"), probe.rows)]
    if exp.ndim == 2:
        exp = exp[:, _positions(reading.get("cols"), probe.cols)]
    val = _values(reading["values"])
    where = f" ({reading['via']})" if reading.get("via") else ""
    if tuple(val.shape) != tuple(exp.shape):
        return f"{name}{where}: engine returned shape {tuple(val.shape)}, expected {tuple(exp.shape)}"
    diff = float((val - exp).abs().max()) if val.numel() else 0.0
    if diff > atol or not bool(torch.isfinite(val).all()):
        return f"{name}{where}: max |engine - trainer| = {diff:.3g} (tolerance {atol:g})"
    return None


def verify_engine(engine, probes: dict[str, _Probe], atol: float = 0.0) -> list[str]:
    """Compare the engine's weights with ``probes``; returns mismatch descriptions."""
    results = engine.probe_weights([p.spec(n) for n, p in probes.items()])
    problems, seen = [], set()
    for res in results:
        dtype = _DTYPES.get(res.get("dtype", ""), torch.float32)
        for name, readings in res["probes"].items():
            if name not in probes:
                continue
            seen.add(name)
            for reading in readings:
                msg = _compare(name, probes[name], reading, dtype, atol)
                if msg:
                    problems.append(msg)
    problems += [f"{n}: no engine worker reported it" for n in probes if n not in seen]
    return problems


@contextlib.contextmanager
def _exact_matmul():
    # TF32 would round the probed weights to 10 mantissa bits on GPU
    if not torch.cuda.is_available():
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def probe_worker_weights(worker, specs) -> dict:
    """Runs inside a vLLM worker: read back slices of HF-named weights.

    specs: [(hf_name, rows, cols)]: ``rows`` None (matrix: W[:, cols]; 1-D: all) or
    vocabulary rows (W[rows], plus the output kernel probed at hidden ``cols``).
    Returns {"dtype": model dtype, "probes": {hf_name: [reading, ...]}}, a reading
    being {"values": float32 tensor, "rows": global rows held here or None (all),
    "cols": global columns or None (all), "via": what was read}; a tensor that
    cannot be resolved gets [{"error": ...}]. Each worker reports its TP shard only.
    """
    model = _worker_model(worker)
    packed = {}
    for fused, subs in (getattr(model, "packed_modules_mapping", None) or {}).items():
        for i, sub in enumerate(subs):
            packed[sub] = (fused, i)
    shared = {id(mods[0]._parameters["weight"]): mods for mods in _sharing_modules(model)}
    out, cache = {}, {}
    with torch.no_grad(), _exact_matmul():
        for name, rows, cols in specs:
            try:
                out[name] = _probe_one(model, packed, shared, name, rows, cols, cache)
            except Exception as e:  # noqa: BLE001 - reported to the trainer by name
                out[name] = [{"error": f"{type(e).__name__}: {e}"}]
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return {"dtype": str(dtype), "probes": out}


def _resolve(model, packed: dict, hf_name: str):
    """(module, parameter name, shard index in a fused module or None)."""
    mod_path, _, pname = hf_name.rpartition(".")
    try:
        return model.get_submodule(mod_path), pname, None
    except AttributeError:
        parent, _, leaf = mod_path.rpartition(".")
        if leaf not in packed:
            raise KeyError(f"engine model has no module {mod_path}") from None
        fused, idx = packed[leaf]
        return model.get_submodule(f"{parent}.{fused}" if parent else fused), pname, idx


def _output_rows(module, shard: Optional[int]):
    """(local row slice, global row indices or None for all) of one shard of a
    column-parallel (possibly fused) layer's output."""
    from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear

    if isinstance(module, RowParallelLinear):
        return slice(None), None
    sizes = list(module.output_partition_sizes)
    idx = shard or 0
    off, size = sum(sizes[:idx]), sizes[idx]
    owner = module.tp_rank
    if isinstance(module, QKVParallelLinear) and idx > 0:
        owner = module.tp_rank // module.num_kv_head_replicas  # kv heads replicated over ranks
    first = owner * size if module.tp_size > 1 else 0
    return slice(off, off + size), list(range(first, first + size))


def _one_hot(cols: list[int], start: int, width: int, module) -> torch.Tensor:
    """[len(cols), width] rows of the identity at ``cols - start`` (the probe input)."""
    x = torch.zeros(len(cols), width, dtype=module.params_dtype,
                    device=next(module.parameters()).device)
    x[torch.arange(len(cols)), torch.tensor(cols, dtype=torch.long) - start] = 1
    return x


def _kernel(module, cols: list[int], start: int, width: int, cache: dict) -> torch.Tensor:
    """module's own kernel applied to one-hot rows at ``cols``: [out_local, len(cols)],
    i.e. exact columns of W even when vLLM prepacked the weight and dropped it."""
    key = (id(module), tuple(cols), start)
    if key not in cache:
        x = _one_hot(cols, start, width, module)
        cache[key] = module.quant_method.apply(module, x, bias=None).t()
    return cache[key]


def _plain(t: torch.Tensor) -> dict:
    """Values as plain lists: vLLM's RPC encoder turns tensors nested in a result into
    unresolved buffer references in a child-process engine; floats survive exactly."""
    t = t.detach().float().cpu()
    return {"shape": list(t.shape), "data": t.reshape(-1).tolist()}


def _values(v) -> torch.Tensor:
    if isinstance(v, torch.Tensor):
        return v.detach().float()
    return torch.tensor(v["data"], dtype=torch.float32).reshape(v["shape"])


def _probe_one(model, packed: dict, shared: dict, name: str, rows, cols, cache: dict) -> list[dict]:
    from vllm.model_executor.layers.linear import LinearBase, RowParallelLinear

    module, pname, shard = _resolve(model, packed, name)
    if rows is not None and hasattr(module, "shard_indices"):
        # Vocabulary-parallel: this rank's real rows come first in its shard.
        si = module.shard_indices
        held = [r for r in rows if si.org_vocab_start_index <= r < si.org_vocab_end_index]
        local = [r - si.org_vocab_start_index for r in held]
        weight = module._parameters[pname]
        readings = [{"rows": held, "cols": None, "values": _plain(weight[local]),
                     "via": "weight"}]
        # Every module computing with this weight (a tied lm_head too) through its own
        # kernel: on CPU each keeps a prepacked copy that can go stale on its own.
        for user in shared.get(id(weight), [module]):
            if not hasattr(user.quant_method, "apply"):
                continue
            y = _kernel(user, list(cols), 0, weight.shape[1], cache)
            readings.append({"rows": held, "cols": list(cols), "values": _plain(y[local]),
                             "via": f"{type(user).__name__} kernel"})
        return readings
    if isinstance(module, LinearBase) and pname == "weight":
        n_in = module.input_size_per_partition
        start = module.tp_rank * n_in if isinstance(module, RowParallelLinear) else 0
        held_cols = [c for c in cols if start <= c < start + n_in]
        y = _kernel(module, held_cols, start, n_in, cache)
        local, held = _output_rows(module, shard)
        return [{"rows": held, "cols": held_cols, "values": _plain(y[local]),
                 "via": f"{type(module).__name__} kernel"}]
    if isinstance(module, LinearBase) and pname == "bias":
        local, held = _output_rows(module, shard)
        return [{"rows": held, "cols": None, "values": _plain(module.bias[local])}]
    t = getattr(module, pname)
    if rows is not None:
        return [{"rows": list(rows), "cols": None, "values": _plain(t[rows])}]
    return [{"rows": None, "cols": None, "values": _plain(t)}]


# =============================================================================== the bridge

@dataclass
class SyncStats:
    """One sync, as seen by this rank."""

    seconds: float = 0.0
    export_seconds: float = 0.0
    """Gathering over TP, mapping, PP broadcasts (excluding the engine's own time)."""
    engine_seconds: float = 0.0
    """Inside update_weights / update_weights_from_file and reset_prefix_cache."""
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
    replica, or none); anything ``as_sync_engine`` accepts.
    """

    model: Any
    model_cfg: ModelConfig
    ps: Any
    engines: Sequence[Any] = ()
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """Target bucket size; peak extra memory is about one bucket plus one module."""
    verify: bool = True
    """Check the engines' weights after every sync (``--verify`` switch)."""
    verify_columns: int = 2
    """Columns (matrices) / rows (embeddings) probed per tensor and sync."""
    verify_atol: float = 0.0
    """Allowed |engine - trainer|; 0 means bitwise (after casting to the engine dtype)."""
    shm_dir: str = "/dev/shm"
    """Where buckets for an engine in another process are written (RAM-backed)."""
    error_group: Any = None
    """Group over which a failed verification is agreed (None: the whole world)."""
    seed: int = 0
    syncs: int = field(default=0, init=False)

    def __post_init__(self):
        if not isinstance(self.engines, (list, tuple)):
            self.engines = [self.engines]
        self.engines = [as_sync_engine(e) for e in self.engines if e is not None]
        mapping.table(self.model_cfg.family)  # unknown family: fail before any collective

    def _active_engines(self) -> list:
        return [e for e in self.engines if getattr(e, "holds_engine", True)]

    def sync(self, *, verify: Optional[bool] = None) -> SyncStats:
        """Push the current weights to the engines. Collective over all ranks."""
        verify = self.verify if verify is None else verify
        engines = self._active_engines()
        stats, probes = SyncStats(), {}
        seed = hash((self.seed, self.syncs)) & 0x7FFFFFFF
        start = time.perf_counter()
        t = start
        for bucket in export_buckets(self.model, self.model_cfg, self.ps, bucket_bytes=self.bucket_bytes):
            stats.export_seconds += time.perf_counter() - t
            nbytes = _nbytes(bucket)
            stats.buckets += 1
            stats.tensors += len(bucket)
            stats.bytes += nbytes
            stats.max_bucket_bytes = max(stats.max_bucket_bytes, nbytes)
            t = time.perf_counter()
            for engine in engines:
                self._deliver(engine, bucket)
            stats.engine_seconds += time.perf_counter() - t
            if verify and engines:
                for name, tensor in bucket:
                    probes[name] = _make_probe(name, tensor, self.model_cfg, self.verify_columns, seed)
            del bucket
            t = time.perf_counter()
        t = time.perf_counter()
        for engine in engines:
            engine.reset_prefix_cache()
        stats.engine_seconds += time.perf_counter() - t
        self.syncs += 1
        if verify:
            t = time.perf_counter()
            problems = []
            for engine in engines:
                problems += verify_engine(engine, probes, self.verify_atol)
            stats.verified_tensors = len(probes) if engines else 0
            self._agree(problems)
            stats.verify_seconds = time.perf_counter() - t
        stats.seconds = time.perf_counter() - start
        log.info("bridge: sync %d: %d tensors, %.1f MB in %d buckets, %.3f s (%.2f GB/s), verify %.3f s",
                 self.syncs, stats.tensors, stats.bytes / 1e6, stats.buckets, stats.seconds,
                 stats.gbps, stats.verify_seconds)
        return stats

    def _deliver(self, engine, bucket: Bucket) -> None:
        if getattr(engine, "weight_transport", "tensors") == "file" or not hasattr(engine, "update_weights"):
            fd, path = tempfile.mkstemp(prefix="grpo_bridge_", suffix=".safetensors", dir=self.shm_dir)
            os.close(fd)
            try:
                write_safetensors(path, bucket)
                engine.update_weights_from_file(path)
            finally:
                os.unlink(path)
        else:
            engine.update_weights(bucket)

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
