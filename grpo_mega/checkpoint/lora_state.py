"""What a LoRA run's checkpoint holds: the adapters and their optimizer state, and a
reference to the frozen base (its path and a fingerprint of its files), never the base.

Layout: one megatron ``ShardedTensor`` per adapter tensor, keyed by its canonical name
(global layer index: ``lora.decoder.layers.3.self_attention.linear_qkv.lora_B.weight``), with
the sharding ``grpo_mega.lora`` gives it, so that a save at one TP x PP x DP layout loads at
any other:

* column-parallel linears (linear_qkv, linear_fc1): A replicated over TP; B sharded along its
  rows like the base weight. fc1's rows are [gate; up] with each half split over TP, so B is
  stored as [2, F, r] (a view of the local [2 F/tp, r]) sharded along axis 1;
* row-parallel linears (linear_proj, linear_fc2): A sharded along its columns; B replicated.

Replicas (TP ranks of a replicated factor, DP ranks) carry a nonzero ``replica_id``, so one
rank writes each piece. The Adam moments follow their parameters
(``trainer_state._optimizer_sharded`` reshapes them like the view).

The base reference: ``grpo_meta.json`` records ``lora.base`` (``model.init_checkpoint`` or
``model.hf_checkpoint``) and ``lora.fingerprint``, a SHA-256 over the names, sizes and bytes
of the base's weight files (computed once per process and path). A resume whose base files
differ is refused, naming both, since adapters on another base are another model.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Optional

from grpo_mega.checkpoint.io import CheckpointError
from grpo_mega.lora import adapted_modules
from grpo_mega.models import layout as mcore_layout
from grpo_mega.models.gpt import unwrap_model

__all__ = ["has_lora", "lora_sharded_state_dict", "base_reference", "base_fingerprint", "check_base",
           "LORA_KEY_PREFIX"]

LORA_KEY_PREFIX = "lora."
_WEIGHT_FILES = (".safetensors", ".distcp", ".bin", ".pt", ".metadata", "metadata.json")


def has_lora(model) -> bool:
    return bool(adapted_modules(model))


def lora_sharded_state_dict(model, ps, num_layers: int) -> dict:
    """This rank's adapter tensors as megatron ``ShardedTensor``s (see the module docstring);
    keys are the local parameter names, as ``sharded_state_dict`` keys them."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    model = unwrap_model(model)
    per = num_layers // ps.pp
    out = {}
    for local, m in adapted_modules(model).items():
        base = mcore_layout.to_global_name(local + ".weight", ps.pp_rank, per)
        column = m.lora_parallel == "column"
        for factor in ("lora_A", "lora_B"):
            p = getattr(m, factor).weight
            key = LORA_KEY_PREFIX + base[:-len(".weight")] + f".{factor}.weight"
            sharded = (factor == "lora_B") == column  # B of a column linear, A of a row linear
            data, offsets = p.data, ()
            if sharded and ps.tp > 1:
                _, gated = mcore_layout.split_rule(base)
                if gated:  # [gate_r; up_r] -> [2, F/tp, r], axis 1 sharded
                    data = data.view(2, data.shape[0] // 2, *data.shape[1:])
                    offsets = ((1, ps.tp_rank, ps.tp),)
                else:
                    offsets = ((0 if column else 1, ps.tp_rank, ps.tp),)
            elif sharded and mcore_layout.split_rule(base)[1]:
                data = data.view(2, data.shape[0] // 2, *data.shape[1:])  # same key shape at tp 1
            replica = (0 if sharded else ps.tp_rank, ps.dp_rank)
            out[f"{local}.{factor}.weight"] = ShardedTensor.from_rank_offsets(key, data, *offsets,
                                                                              replica_id=replica)
    return out


_FINGERPRINTS: dict = {}


def base_fingerprint(path: str | os.PathLike) -> str:
    """SHA-256 over the relative names, sizes and bytes of the weight files under ``path``
    (an HF directory or a megatron checkpoint); cached per path, size and mtime."""
    root = Path(path)
    files = sorted(f for f in root.rglob("*") if f.is_file() and f.name.endswith(_WEIGHT_FILES))
    if not files:
        raise CheckpointError(f"LoRA base {root} holds no weight files to fingerprint "
                              "(model.hf_checkpoint / model.init_checkpoint)")
    stamp = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    if stamp not in _FINGERPRINTS:
        h = hashlib.sha256()
        for f in files:
            h.update(f"{f.relative_to(root)}\0{f.stat().st_size}\0".encode())
            with open(f, "rb") as fh:
                while chunk := fh.read(1 << 24):
                    h.update(chunk)
        _FINGERPRINTS[stamp] = h.hexdigest()
    return _FINGERPRINTS[stamp]


def _base_path(model_cfg: dict) -> Optional[str]:
    return model_cfg.get("init_checkpoint") or model_cfg.get("hf_checkpoint") or None


def base_reference(model_cfg: dict) -> dict:
    """``grpo_meta.json``'s ``lora`` entry for a run of model section ``model_cfg`` (a dict)."""
    base = _base_path(model_cfg)
    lora = model_cfg.get("lora") or {}
    return {"base": base, "fingerprint": base_fingerprint(base) if base else None,
            "rank": lora.get("rank"), "alpha": lora.get("alpha"),
            "target_modules": list(lora.get("target_modules") or ())}


def check_base(meta: dict, model_cfg, has_adapters: bool, ckpt: Path) -> None:
    """Refuse to resume adapters into a full model (or the reverse), adapters of another
    shape than ``model_cfg.lora``, or adapters on another base than the configured one."""
    saved = meta.get("lora")
    if has_adapters and saved is None:
        raise CheckpointError(f"checkpoint {ckpt} holds a full model, not LoRA adapters, but model.lora is set; "
                              "resume it without model.lora, or start the LoRA run in another --checkpoint.dir")
    if saved is not None and not has_adapters:
        raise CheckpointError(f"checkpoint {ckpt} holds LoRA adapters (rank {saved.get('rank')}) on the base "
                              f"{saved.get('base')}; set model.lora (--model.lora.rank={saved.get('rank')}) "
                              "to resume it")
    lora = getattr(model_cfg, "lora", None)
    if saved is None or lora is None:
        return
    for field, want in (("rank", lora.rank), ("alpha", lora.alpha),
                        ("target_modules", list(lora.target_modules))):
        if saved.get(field) is not None and saved.get(field) != want:
            raise CheckpointError(f"checkpoint {ckpt} holds adapters with model.lora.{field}={saved[field]!r}, "
                                  f"the config says {want!r}; set --model.lora.{field} to match")
    base = getattr(model_cfg, "init_checkpoint", None) or getattr(model_cfg, "hf_checkpoint", None)
    if saved.get("fingerprint") and base:
        now = base_fingerprint(base)
        if now != saved["fingerprint"]:
            raise CheckpointError(
                f"checkpoint {ckpt} holds adapters trained on the base {saved.get('base')} (fingerprint "
                f"{saved['fingerprint'][:12]}), but the configured base {base} has other weights "
                f"({now[:12]}); point --model.hf_checkpoint / --model.init_checkpoint at the adapters' base")
