"""Checkpoint verification: megatron logits against transformers logits on the same
weights (``tools/verify_checkpoint.py``)."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from grpo_mega.checkpoint.convert import load_hf_weights, load_mcore_weights, read_model_config
from grpo_mega.checkpoint.io import Progress, _ensure_world, _say


def compare_logits(hf_dir: str | os.PathLike, ckpt_dir: str | os.PathLike, *, batch: int = 2,
                   seq_len: int = 16, seed: int = 0, progress: Progress = print) -> float:
    """Max |logits_HF - logits_megatron| on random tokens (TP=1, PP=1, float32).

    The HF side runs in transformers, the megatron side loads ``ckpt_dir`` with
    ``load_mcore_weights`` (or an HF directory with ``load_hf_weights``).
    """
    from transformers import AutoModelForCausalLM

    from grpo_mega.models import build_model, forward_logits
    from grpo_mega.distributed.state import init_parallel

    cfg = dataclasses.replace(read_model_config(ckpt_dir), dtype="float32")
    _ensure_world()
    ps = init_parallel(1, 1)
    model = build_model(cfg, ps, frozen=True)
    if (Path(ckpt_dir) / "metadata.json").is_file():
        load_mcore_weights(model, ckpt_dir, ps, cfg)
    else:
        load_hf_weights(model, ckpt_dir, ps, cfg)
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=gen)
    with torch.no_grad():
        ours = forward_logits(model, tokens)[..., :cfg.vocab_size].float()
        theirs = hf(tokens).logits.float()
    diff = float((ours - theirs).abs().max())
    _say(progress, f"[verify] {batch}x{seq_len} random tokens, vocab {cfg.vocab_size}: "
                   f"max |logits_hf - logits_mcore| = {diff:.3e} (logit scale {float(theirs.abs().max()):.3g})")
    return diff
