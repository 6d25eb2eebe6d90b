"""vLLM mixture-of-experts layers inside a worker: in-place reload and weight probes.

Runs inside a vLLM worker (called from :mod:`grpo_mega.rollout.worker`); vLLM is
imported lazily. Three things vLLM 0.32 (CPU) does not do for an MoE model whose
weights are updated in place by ``reload_weights``:

* **Re-prepacking the experts** (:func:`experts_reprocessed`). On the first load
  ``UnquantizedFusedMoEMethod._setup_kernel`` builds the MoE kernel and then calls
  ``moe_kernel.fused_experts.process_weights_after_loading(layer)``; on CPU that is
  ``CPUUnquantizedExperts.process_weights_after_loading``, which pads the intermediate
  dim and rewrites ``w13_weight`` / ``w2_weight`` in the grouped-GEMM layout of
  ``cpu_prepack_moe_weight`` (same shape, elements permuted). On a reload
  ``_setup_kernel`` sees ``self.moe_kernel is not None`` ("is_weight_update") and skips
  that call, so the layerwise reloader (``model_loader/reload/layerwise.py::
  _copy_and_restore_kernel_tensors``) copies the NEW weights in checkpoint layout
  into the prepacked storage: the kernel then reads a permutation of the new weights
  (measured: log-prob gap 0.13 to the new model, 2.05 to the old). We make vLLM take
  its first-load path again by clearing ``moe_kernel`` on those layers for the
  duration of the reload (it rebuilds the kernel and prepacks), and put the old kernel
  back on every layer vLLM did not reprocess.
* **Whole layers only** (:func:`check_whole_moe_layers`). The reloader treats one
  vLLM MoE layer (every expert's gate, up and down) as one unit: a partial update
  materialises the layer with uninitialised memory and loads only the experts sent
  (measured: NaN log-probs). Such an update is refused by name.
* **Reading experts back** (:func:`probe_expert`). The prepacked weights cannot be
  read as matrices, and the MoE kernel is not linear in them. The layout is learnt by
  pushing index tensors through the experts' own post-load step (a copy of
  ``fused_experts`` on a scratch module), which gives each checkpoint element's
  position in the packed tensor; the probe then reads exact values.

HF expert names are ``<layer>.mlp.experts.<E>.{gate,up,down}_proj.weight`` (Qwen3-MoE,
the form vLLM's ``RoutedExperts.build_expert_params_mapping`` loads); the vLLM module
holding them is ``<layer>.mlp.experts`` or its ``routed_experts`` child.
"""
from __future__ import annotations

import contextlib
import copy
import re
from typing import Optional

import torch

__all__ = ["EXPERT_NAME", "moe_layers", "check_whole_moe_layers", "experts_reprocessed",
           "probe_expert"]

EXPERT_NAME = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\."
                         r"(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_PROJS = ("gate_proj", "up_proj", "down_proj")
_ROUTED_CHILD = ".routed_experts"  # RoutedExperts' default routed_experts_prefix


def moe_layers(model) -> dict:
    """{HF prefix ("model.layers.N.mlp.experts"): the vLLM module holding w13/w2}."""
    out = {}
    for name, m in model.named_modules():
        if "w13_weight" in getattr(m, "_parameters", {}) and hasattr(m, "quant_method"):
            out[name[: -len(_ROUTED_CHILD)] if name.endswith(_ROUTED_CHILD) else name] = m
    return out


def check_whole_moe_layers(model, names) -> None:
    """Raise ValueError if ``names`` (one update) holds some but not all expert tensors
    of an MoE layer: vLLM would rebuild that layer's other experts from uninitialised
    memory (see the module docstring)."""
    layers = moe_layers(model)
    got: dict[str, set] = {}
    for n in names:
        m = EXPERT_NAME.match(n)
        if m and m["prefix"] in layers:
            got.setdefault(m["prefix"], set()).add((int(m["expert"]), m["proj"]))
    for prefix, have in got.items():
        want = {(e, p) for e in range(layers[prefix].global_num_experts) for p in _PROJS}
        if have != want:
            missing = sorted(want - have)[:3]
            raise ValueError(
                f"weight update holds {len(have & want)} of the {len(want)} expert tensors of "
                f"{prefix} (missing e.g. {', '.join(f'{prefix}.{e}.{p}.weight' for e, p in missing)}); "
                "vLLM reloads an MoE layer as one unit and fills the experts not sent with "
                "uninitialised memory: send every expert of an MoE layer in the same update")


def _skipped_on_update(quant_method) -> bool:
    """True for layers whose experts have their own post-load step that vLLM's
    weight-update branch of ``UnquantizedFusedMoEMethod._setup_kernel`` skips."""
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    kernel = getattr(quant_method, "moe_kernel", None)
    return (isinstance(quant_method, UnquantizedFusedMoEMethod) and kernel is not None
            and type(kernel.fused_experts).process_weights_after_loading
            is not FusedMoEExperts.process_weights_after_loading)


@contextlib.contextmanager
def experts_reprocessed(model):
    """Within the block, a reload of an MoE layer redoes vLLM's first-load processing
    (kernel rebuilt, experts prepacked); layers not reloaded keep their kernel."""
    held = []
    for layer in moe_layers(model).values():
        qm = layer.quant_method
        if _skipped_on_update(qm):
            held.append((qm, qm.moe_kernel))
            qm.moe_kernel = None
    try:
        yield
    finally:
        for qm, kernel in held:
            if qm.moe_kernel is None:  # vLLM did not process this layer: old weights, old kernel
                qm.moe_kernel = kernel


# ----------------------------------------------------------------------------- probes

# MoE backends whose kernels read w13/w2 in checkpoint layout, or in a layout the experts' own
# post-load step makes (which _positions learns). vLLM 0.26.0 on GPU reshuffles the weights
# for the others in ``convert_to_unquantized_kernel_format`` (FlashInfer CUTLASS swaps the
# gate and up halves, FlashInfer TRTLLM re-blocks them, AITER shuffles), a step the probe
# does not see: it would read the wrong elements. FlashInfer is preferred on Blackwell.
_PROBED_BACKENDS = ("TRITON", "BATCHED_TRITON", "CPU")


def _check_known_layout(layer, name: str) -> None:
    """Refuse to probe an MoE layer whose weights vLLM reshuffled for its kernel."""
    backend = getattr(getattr(layer, "quant_method", None), "unquantized_backend", None)
    if backend is not None and backend.name not in _PROBED_BACKENDS:
        raise NotImplementedError(
            f"cannot verify {name}: vLLM's {backend.value} MoE kernels hold the experts in a "
            "reshuffled layout this probe does not read. Skip the check with "
            "--rollout.verify_sync=false, or run vLLM's Triton MoE kernels (the engine argument "
            "moe_backend='triton', through EngineConfig.extra)")

_LAYOUTS: dict = {}


def _local_shapes(layer) -> tuple[tuple[int, int], tuple[int, int]]:
    """Per-expert (w13, w2) shapes before the experts' post-load step: [2 I, H], [H, I]."""
    cfg = layer.moe_config
    if not cfg.is_act_and_mul:
        raise NotImplementedError("probing non-gated MoE experts is not supported")
    i, h = cfg.intermediate_size_per_partition, cfg.hidden_dim
    return (2 * i, h), (h, i)


def _positions(layer) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(pos13 [2I, H], pos2 [H, I], packed numel per expert of w13, of w2): where each
    element of expert 0's checkpoint-layout matrices sits in the flattened processed
    tensors; expert e is offset by e times the packed numel (checked on two experts)."""
    fe = layer.quant_method.moe_kernel.fused_experts
    s13, s2 = _local_shapes(layer)
    dtype = layer.w13_weight.dtype
    key = (type(fe), getattr(fe, "isa", None), dtype, s13, s2)
    if key in _LAYOUTS:
        return _LAYOUTS[key]
    n = 2 if layer.local_num_experts >= 2 else 1
    numel = n * max(s13[0] * s13[1], s2[0] * s2[1])
    idx13 = torch.arange(1, n * s13[0] * s13[1] + 1).reshape(n, *s13)  # 0 marks padding
    idx2 = torch.arange(1, n * s2[0] * s2[1] + 1).reshape(n, *s2)
    got13 = got2 = None
    base = 1
    # Index digits in base 256 are exact in every float dtype vLLM packs (bf16 has 8
    # mantissa bits), and a permuting prepack moves them unchanged.
    while base <= numel:
        scratch = torch.nn.Module()
        scratch.moe_config, scratch.activation = layer.moe_config, getattr(layer, "activation", None)
        for pname, idx in (("w13_weight", idx13), ("w2_weight", idx2)):
            digit = ((idx // base) % 256).to(dtype).to(layer.w13_weight.device)
            scratch.register_parameter(pname, torch.nn.Parameter(digit, requires_grad=False))
        copy.copy(fe).process_weights_after_loading(scratch)  # the copy keeps fe's state intact
        d13, d2 = (getattr(scratch, p).detach().cpu().to(torch.int64) for p in ("w13_weight", "w2_weight"))
        got13 = d13 * base if got13 is None else got13 + d13 * base
        got2 = d2 * base if got2 is None else got2 + d2 * base
        base *= 256
    out = []
    for got, shape in ((got13, s13), (got2, s2)):
        flat = got.reshape(-1)
        per = flat.numel() // n
        pos = torch.full((n * shape[0] * shape[1],), -1, dtype=torch.int64)
        where = (flat > 0).nonzero()[:, 0]
        pos[flat[where] - 1] = where
        pos = pos.reshape(n, *shape)
        if bool((pos < 0).any()) or (n == 2 and not torch.equal(pos[1], pos[0] + per)):
            raise RuntimeError(f"cannot read back {type(fe).__name__} expert weights: their "
                               "post-load step is not a per-expert permutation")
        out += [pos[0], per]
    _LAYOUTS[key] = (out[0], out[2], out[1], out[3])
    return _LAYOUTS[key]


def probe_expert(model, name: str, cols: list[int]) -> Optional[list[dict]]:
    """Readings of expert weight W[:, cols] (HF layout [out, in]) for an HF expert name,
    or None when ``name`` is not an expert of this model. At vLLM TP > 1 each worker
    reports the intermediate rows (gate / up) or columns (down) it holds."""
    m = EXPERT_NAME.match(name)
    layer = moe_layers(model).get(m["prefix"]) if m else None
    if layer is None:
        return None
    if getattr(layer, "expert_map", None) is not None:
        raise NotImplementedError("probing experts under vLLM expert parallelism is not supported")
    _check_known_layout(layer, name)
    e, proj = int(m["expert"]), m["proj"]
    pos13, pos2, per13, per2 = _positions(layer)
    cfg = layer.moe_config
    i_loc = cfg.intermediate_size_per_partition
    i_ckpt = cfg.intermediate_size_per_partition_unpadded or i_loc  # rows the checkpoint fills
    first = cfg.moe_parallel_config.tp_rank * i_ckpt  # this worker's first intermediate row
    if proj == "down_proj":  # [H, I]: columns are intermediate
        held = [c for c in cols if first <= c < first + i_ckpt]
        at = pos2[:, [c - first for c in held]] + e * per2
        vals = layer.w2_weight.detach().reshape(-1)[at.reshape(-1).to(layer.w2_weight.device)]
        return [{"rows": None, "cols": held, "values": vals.reshape(at.shape),
                 "via": f"{type(layer).__name__} w2 (unpacked)"}]
    off = 0 if proj == "gate_proj" else i_loc
    at = pos13[off:off + i_ckpt][:, list(cols)] + e * per13
    vals = layer.w13_weight.detach().reshape(-1)[at.reshape(-1).to(layer.w13_weight.device)]
    rows = list(range(first, first + i_ckpt)) if cfg.moe_parallel_config.tp_size > 1 else None
    return [{"rows": rows, "cols": list(cols), "values": vals.reshape(at.shape),
             "via": f"{type(layer).__name__} w13 (unpacked)"}]
