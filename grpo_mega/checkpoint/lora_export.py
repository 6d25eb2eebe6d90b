"""A LoRA run's checkpoint out as a Hugging Face PEFT adapter directory, or as a merged HF model.

What (``tools/convert_checkpoint.py lora-to-peft``):

* ``lora_to_peft(step_dir, out)``: ``adapter_config.json`` (``r``, ``lora_alpha``,
  ``target_modules`` in HF names from the family's mapping table,
  ``base_model_name_or_path``: the base the checkpoint references) and
  ``adapter_model.safetensors`` with PEFT's names,
  ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` [r, in] and
  ``...lora_B.weight`` [out, r]. megatron's fused linears are several HF modules: q, k and v
  (gate and up) get the same A and B's rows split by the table (``bridge.lora.peft_pairs``),
  which is exact: (B A)'s rows are B's rows times A. ``peft.PeftModel.from_pretrained`` and
  vLLM's ``LoRARequest`` load the directory as it is.
* ``merged=True``: an HF model directory instead, the base's weights with W + scale * B A
  on every adapted linear (computed in float64, stored in the base's dtype), config and
  tokenizer copied from the base.

The adapters are read from the checkpoint's ``lora.*`` tensors (``lora_state``; unsharded
whatever layout saved them) after the same index checks as every load (``io``). Output
appears by one rename of a finished temporary directory.
"""
from __future__ import annotations

import json
import shutil
import types
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from grpo_mega.bridge.lora import peft_pairs, peft_target_modules
from grpo_mega.checkpoint.convert import _load_tensors_metadata, _write_hf_side_files
from grpo_mega.checkpoint.hf_files import HFReader, _ShardWriter
from grpo_mega.checkpoint.io import (CheckpointError, Progress, _check_out, _ensure_world, _publish_collectively,
                                     _say, _shared_tmp_dir, weights_only_loads)
from grpo_mega.checkpoint.lora_state import LORA_KEY_PREFIX
from grpo_mega.models import hf as mapping

__all__ = ["lora_to_peft", "read_adapters"]


def _meta(step_dir: Path) -> dict:
    f = step_dir / "grpo_meta.json"
    if not f.is_file():
        raise CheckpointError(f"{step_dir} is not a grpo-mega trainer checkpoint (no grpo_meta.json); "
                              "pass a step_* directory of checkpoint.dir")
    meta = json.loads(f.read_text())
    if "lora" not in meta or "model" not in meta:
        raise CheckpointError(f"{step_dir} holds no LoRA adapters (its run had no model.lora); "
                              "use mcore-to-hf for a full checkpoint")
    return meta


def read_adapters(step_dir: str | Path, allow_unsafe_load: bool = False
                  ) -> tuple[dict, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """(the checkpoint's meta, {canonical base-weight name: (full A [r, in], full B [out, r])})."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    step_dir = Path(step_dir)
    meta = _meta(step_dir)
    _ensure_world()
    index = _load_tensors_metadata(step_dir, allow_unsafe_load)
    sharded = {k: ShardedTensor.from_rank_offsets(k, torch.empty(tuple(md.global_shape), dtype=md.dtype),
                                                  replica_id=0)
               for k, md in index.items() if k.startswith(LORA_KEY_PREFIX)}
    if not sharded:
        raise CheckpointError(f"{step_dir}: no {LORA_KEY_PREFIX}* tensors in the checkpoint")
    with weights_only_loads(not allow_unsafe_load):
        loaded = dist_checkpointing.load(sharded, str(step_dir), validate_access_integrity=False)
    out: dict = {}
    for key, t in loaded.items():
        module, factor = key[len(LORA_KEY_PREFIX):].rsplit(".", 2)[:2]
        t = t.reshape(-1, t.shape[-1]) if t.ndim == 3 else t  # fc1's B: [2, F, r] -> [2F, r]
        out.setdefault(module + ".weight", {})[factor] = t
    return meta, {n: (f["lora_A"], f["lora_B"]) for n, f in out.items()}


def _shape(meta: dict):
    """The mapping tables take any object with ModelConfig's shape fields."""
    return types.SimpleNamespace(**{k: v for k, v in meta["model"].items()})


def lora_to_peft(step_dir: str | Path, out_dir: str | Path, *, merged: bool = False,
                 base_dir: Optional[str | Path] = None, overwrite: bool = False,
                 allow_unsafe_load: bool = False, progress: Progress = print) -> Path:
    """Write the adapters of trainer checkpoint ``step_dir`` as a PEFT directory (or, with
    ``merged``, a merged HF model) at ``out_dir``. ``base_dir``: the HF base (default: the
    one the checkpoint references); needed for ``merged`` and copied into the config."""
    step_dir, out = Path(step_dir), Path(out_dir)
    _check_out(out, overwrite)
    meta, adapters = read_adapters(step_dir, allow_unsafe_load)
    cfg, lora = _shape(meta), meta["model"]["lora"]
    base = Path(base_dir) if base_dir else (Path(meta["lora"]["base"]) if meta["lora"].get("base") else None)
    scale = float(lora["alpha"]) / int(lora["rank"])
    tmp = _shared_tmp_dir(out)
    try:
        if merged and (base is None or not (base / "config.json").is_file()):
            raise CheckpointError(f"--merged needs the HF base model directory; {base} is not one (--base)")
        # every rank read the adapters; one writes (in a distributed run the others would race
        # it on the same files of the shared directory) and the publish below waits for it
        if not dist.is_initialized() or dist.get_rank() == 0:
            if merged:
                _write_merged(tmp, base, cfg, adapters, scale)
            else:
                _write_peft(tmp, cfg, lora, adapters, base)
        _publish_collectively(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _say(progress, f"[lora-to-peft] {'merged model' if merged else 'adapter'}: {out} "
                   f"({len(adapters)} adapted linears, rank {lora['rank']})")
    return out


def _write_peft(tmp: Path, cfg, lora: dict, adapters: dict, base: Optional[Path]) -> None:
    from grpo_mega.common.safetensors_io import write_safetensors

    pairs = [p for name, (a, b) in adapters.items() for p in peft_pairs(name, a, b, cfg)]
    write_safetensors(str(tmp / "adapter_model.safetensors"), [(n, t.contiguous()) for n, t in sorted(pairs)],
                      metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(lora["rank"]),
              "lora_alpha": float(lora["alpha"]), "lora_dropout": float(lora.get("dropout", 0.0)),
              "target_modules": peft_target_modules(cfg, lora["target_modules"]), "bias": "none",
              "fan_in_fan_out": False, "inference_mode": True,
              "base_model_name_or_path": str(base) if base else None}
    (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _write_merged(tmp: Path, base: Path, cfg, adapters: dict, scale: float) -> None:
    reader = HFReader(base)
    writer = _ShardWriter(tmp, 5 * 2**30)
    for name in mapping.canonical_names(cfg):
        if not mapping.hf_names_for(name, cfg):
            continue  # the tied output layer
        w = mapping.hf_to_canonical(name, reader.get, cfg)
        if name in adapters:
            a, b = adapters[name]
            w = (w.double() + scale * (b.double() @ a.double())).to(w.dtype)
        writer.add(mapping.canonical_to_hf(name, w, cfg))
    writer.finish()
    _write_hf_side_files(tmp, base, cfg)
