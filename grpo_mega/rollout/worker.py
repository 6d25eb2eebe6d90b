"""Everything that runs inside a vLLM worker: weight reload, tied-weight repack, probes.

Why a worker extension: an engine core in a child process runs worker code
only by method name (pickled callables need VLLM_ALLOW_INSECURE_SERIALIZATION),
so :class:`WorkerExtension` (mixed into vLLM's worker through
``EngineConfig.worker_extension_cls``) carries every such entry point, and the
engine calls them with ``collective_rpc("<method name>", ...)`` in every mode.

* ``grpo_mega_update(named_tensors, finish)`` / ``grpo_mega_update_from_file(path, finish)``
  and ``grpo_mega_finish_update()``: vLLM's ``reload_weights`` (HF names; redoes
  qkv / gate_up fusion and CPU prepacking) spread over the buckets of one sync, so
  vLLM walks the model once per sync (:func:`reload_weights`), then the repack of
  modules sharing a reloaded weight: on CPU a tied lm_head keeps its own prepacked
  copy of the embedding, which plain ``reload_weights`` leaves stale (new
  embedding, old logits).
  MoE layers: see :mod:`grpo_mega.rollout.vllm_moe` (experts re-prepacked, whole
  layers only).
* ``grpo_mega_probe(specs)``: read back slices of HF-named weights for the
  weight bridge's verification. vLLM's CPU linear layers drop their weight
  after prepacking it, so a weight is read through the layer's own kernel:
  multiplying by one-hot rows returns exact columns of W. MoE experts are read
  from their prepacked tensors through a layout learnt from vLLM's own prepack.

The file transport (:func:`write_weight_file`) is the engine side of
``grpo_mega_update_from_file``: a safetensors file in RAM-backed /dev/shm,
never a checkpoint on disk, never pickled lists. vLLM is imported lazily.
"""
from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import torch

from grpo_mega.rollout import vllm_moe
from grpo_mega.common.safetensors_io import write_safetensors

__all__ = ["WorkerExtension", "reload_weights", "reload_weights_from_file", "finish_reload", "probe_weights",
           "repack_shared_weights", "write_weight_file", "WEIGHT_FILE_PREFIX"]

WEIGHT_FILE_PREFIX = "grpo_mega_weights_"


class WorkerExtension:
    """Mixed into vLLM's worker (``worker_extension_cls``); methods are called by
    name through ``LLM.collective_rpc``. ``self`` is the vLLM worker."""

    def grpo_mega_update(self, named_tensors, finish: bool = True) -> int:
        return reload_weights(self, named_tensors, finish)

    def grpo_mega_update_from_file(self, path: str, finish: bool = True) -> int:
        return reload_weights_from_file(self, path, finish)

    def grpo_mega_finish_update(self) -> int:
        return finish_reload(self)

    def grpo_mega_probe(self, specs) -> dict:
        return probe_weights(self, specs)

    def grpo_mega_probe_lora(self, lora_id: int, specs) -> dict:
        from grpo_mega.rollout.lora_adapter import probe_adapter
        return probe_adapter(self, lora_id, specs)


def reload_weights(worker, named_tensors, finish: bool = True) -> int:
    """Runs inside a vLLM worker: load HF-named tensors in place, as part of one reload.

    This is vLLM's ``reload_weights`` (HF names in; qkv / gate_up fusion and CPU
    prepacking redone) cut at its seams so that one reload can span many calls: the
    first call opens it (``initialize_layerwise_reload``: every layer's kernel tensors
    set aside), each call feeds its tensors to ``model.load_weights`` (a layer is
    processed as soon as all its weights are in), and ``finish`` (here, or a later
    :func:`finish_reload`) closes it. Why: a reload walks the whole model when it closes
    and puts every layer that got nothing back from its kernel tensors, logging
    "Failed to load weights" for each; one reload per bucket made a sync B whole-model
    passes (and ~370 such lines per step for a 30-layer model). The weight bridge sends
    every bucket with ``finish=False`` and closes once after the last.
    ``model.load_weights`` on the live model without this frame fails on CPU (weights
    are prepacked at load and replaced by empty tensors).

    Each call must hold whole fused layers (q, k, v together; all experts of an MoE layer:
    vLLM processes a layer once all its weights are in, so a split one would be processed
    half-loaded); an MoE layer split across calls is refused by name. A failing call
    closes the reload (layers not yet loaded keep their weights) and raises."""
    named_tensors = list(named_tensors)
    model = _worker_model(worker)
    # MoE layers: vLLM's reload neither re-prepacks CPU experts nor keeps the experts
    # a partial update leaves out (grpo_mega.rollout.vllm_moe has the vLLM functions).
    vllm_moe.check_whole_moe_layers(model, [n for n, _ in named_tensors])
    names = _open_reload(worker, model)
    try:
        model.load_weights(named_tensors)
    except BaseException:
        finish_reload(worker)
        raise
    names.update(n for n, _ in named_tensors)
    if finish:
        finish_reload(worker)
    return len(named_tensors)


@dataclass
class _OpenReload:
    """A reload spanning several ``reload_weights`` calls (held on the worker)."""

    moe: contextlib.ExitStack
    """Held open for the reload's whole span (``vllm_moe.experts_reprocessed``)."""
    quiet: set
    """Class names of layers that receive no tensor by design (see ``_no_tensor_by_design``)."""
    names: set = field(default_factory=set)
    """HF names loaded so far."""


def _open_reload(worker, model) -> set:
    """The names loaded so far by the open reload, opening one if none is."""
    state = getattr(worker, "_grpo_mega_reload", None)
    if state is None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        # before vLLM sets the layers on meta (tied modules then stop sharing a Parameter)
        state = _OpenReload(contextlib.ExitStack(), _no_tensor_by_design(model))
        state.moe.enter_context(vllm_moe.experts_reprocessed(model))
        try:
            initialize_layerwise_reload(model)
        except BaseException:
            state.moe.close()
            raise
        worker._grpo_mega_reload = state
    return state.names


def finish_reload(worker) -> int:
    """Runs inside a vLLM worker: close the open reload (no-op when none is open).

    vLLM's ``finalize_layerwise_reload`` (layers that received nothing get their kernel
    tensors back: their weights are unchanged), then the repack of modules sharing a
    reloaded weight: on CPU a tied lm_head keeps its own prepacked copy of the embedding,
    which the reload does not refresh (the lm_head received no tensor), so it would keep
    producing logits from the old weights while the embedding is new. Then the runner's
    caches derived from weights are dropped, as vLLM's ``reload_weights`` does. Returns
    the number of tensors the reload loaded."""
    state = getattr(worker, "_grpo_mega_reload", None)
    if state is None:
        return 0
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    worker._grpo_mega_reload = None
    model, runner = _worker_model(worker), worker.model_runner
    quiet = _Expected(state.quiet)
    layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    layerwise.addFilter(quiet)
    try:
        with state.moe:
            finalize_layerwise_reload(model, runner.model_config)
    finally:
        layerwise.removeFilter(quiet)
    repack_shared_weights(model, state.names)
    for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
        if hasattr(runner, reset):
            getattr(runner, reset)()
    return len(state.names)


def _no_tensor_by_design(model) -> set:
    """Class names of the layers an update never sends a tensor to, which vLLM's reload
    puts back from their kernel tensors with a "Failed to load weights" warning each:
    modules sharing a weight with another (a tied lm_head: the checkpoint has no
    ``lm_head.weight``; repacked after the reload) and modules holding buffers but no
    parameters (a rotary embedding's cos/sin cache, computed from the config)."""
    quiet = {type(m).__name__ for group in _sharing_modules(model) for m in group[1:]}
    for m in model.modules():
        if not m._parameters and any(b is not None for b in m._buffers.values()):
            quiet.add(type(m).__name__)
    return quiet


class _Expected(logging.Filter):
    """Drops vLLM's "<layer class>: Failed to load weights" for the classes given; the
    same line for any other layer (a weight the update really missed) still shows."""

    def __init__(self, classes: set):
        super().__init__()
        self.classes = classes

    def filter(self, record: logging.LogRecord) -> bool:
        layer, _, rest = record.getMessage().partition(": ")
        return not (rest == "Failed to load weights" and layer in self.classes)


def reload_weights_from_file(worker, path: str, finish: bool = True) -> int:
    """Runs inside a vLLM worker: :func:`reload_weights` from a safetensors file."""
    from safetensors import safe_open

    with safe_open(path, framework="pt", device="cpu") as f:
        tensors = [(k, f.get_tensor(k)) for k in f.keys()]
    return reload_weights(worker, tensors, finish)


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


def repack_shared_weights(model, loaded: Optional[Sequence[str]] = None) -> int:
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


def probe_weights(worker, specs) -> dict:
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
    from vllm.model_executor.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear

    if isinstance(module, (RowParallelLinear, ReplicatedLinear)):  # every output row held
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


def _probe_one(model, packed: dict, shared: dict, name: str, rows, cols, cache: dict) -> list[dict]:
    from vllm.model_executor.layers.linear import LinearBase, RowParallelLinear

    experts = vllm_moe.probe_expert(model, name, list(cols or ()))
    if experts is not None:  # prepacked MoE experts, read through their learnt layout
        return [dict(r, values=_plain(r["values"])) for r in experts]
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
        # ReplicatedLinear (an MoE router) holds its whole input width
        n_in = getattr(module, "input_size_per_partition", module.input_size)
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


def clear_dead_weight_files(shm_dir: str = "/dev/shm") -> list[str]:
    """Remove weight files whose writer (the pid in their name) is no longer alive: a trainer
    SIGKILLed mid-sync in ``child`` mode never reaches the ``finally`` that unlinks its file,
    and each such file holds a bucket of weights in RAM until the machine reboots."""
    removed = []
    for name in os.listdir(shm_dir):
        if not name.startswith(WEIGHT_FILE_PREFIX):
            continue
        pid = name[len(WEIGHT_FILE_PREFIX):].split("_", 1)[0]
        if not pid.isdigit() or _pid_alive(int(pid)):
            continue
        try:
            os.unlink(os.path.join(shm_dir, name))
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


@contextlib.contextmanager
def write_weight_file(named_tensors: Sequence[tuple[str, torch.Tensor]], shm_dir: str = "/dev/shm"
                      ) -> Iterator[str]:
    """Engine side of the file transport: the tensors as one safetensors file in
    ``shm_dir`` for the duration of the ``with`` block (the worker reads it inside),
    removed afterwards even on error. Refuses early when the RAM disk is too small."""
    need = sum(t.numel() * t.element_size() for _, t in named_tensors)
    st = os.statvfs(shm_dir)
    free = st.f_bavail * st.f_frsize
    if need * 1.05 > free:
        raise RuntimeError(f"weight update needs {need / 2**30:.2f} GiB in {shm_dir} but only "
                           f"{free / 2**30:.2f} GiB are free; send smaller buckets or enlarge "
                           "/dev/shm (docker: --shm-size)")
    # The writer's pid in the name: a file left by a killed trainer is recognisably dead.
    fd, path = tempfile.mkstemp(prefix=f"{WEIGHT_FILE_PREFIX}{os.getpid()}_", suffix=".safetensors",
                                dir=shm_dir)
    os.close(fd)
    try:
        write_safetensors(path, named_tensors)
        yield path
    finally:
        os.unlink(path)
