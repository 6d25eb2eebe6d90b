"""The trained model out as a Hugging Face directory, written from the live model.

What: :func:`write_hf_dir` takes ``(HF name, full tensor)`` pairs (the weight bridge's
``export_hf_weights``: the same mapping table and gathers that feed vLLM every step) and
writes safetensors shards, ``config.json`` and the tokenizer files (chat template
included) copied from the model's source directory, into a directory that
``transformers.AutoModelForCausalLM.from_pretrained`` and vLLM load as they are. The
trainer calls it at the end of training (``checkpoint.export_hf: end``) and, on request,
at every checkpoint (``checkpoint.export_hf: checkpoints``).

Why from the live model and not by converting the last checkpoint afterwards: the
checkpoint is megatron's sharded format; turning it into HF files is a second job
(``tools/convert_checkpoint.py mcore-to-hf``, which remains for checkpoints already
saved), and a run should end with a model a person can serve.

Rules: collective over the default group (every rank consumes the pairs, global rank 0
writes); the output appears by one rename of a finished temporary directory, and an
earlier export it replaces is moved aside first and removed only after the new one is in
place (``io._publish``, shared with the conversion tool), so a kill at any moment leaves a
complete directory (the old or the new) and at most a ``.<name>.tmp-*`` / ``<name>.old``
sibling. Nothing is read from the output directory.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Iterable

import torch
import torch.distributed as dist

from grpo_mega.checkpoint.convert import _write_hf_side_files
from grpo_mega.checkpoint.hf_files import _ShardWriter
from grpo_mega.checkpoint.io import Progress, _publish_collectively, _say, _shared_tmp_dir, _tmp_dir_for
from grpo_mega.config import ModelConfig

__all__ = ["EXPORT_INFO", "write_hf_dir"]

EXPORT_INFO = "grpo_mega_export.json"
"""What the directory holds: the training step, the source model directory and the time."""


def write_hf_dir(pairs: Iterable[tuple[str, torch.Tensor]], out_dir: str | os.PathLike,
                 source_dir: str | os.PathLike | None, cfg: ModelConfig, *, step: int,
                 max_shard_bytes: int = 5 * 2**30, progress: Progress = print) -> Path:
    """Write ``pairs`` (every rank passes its iterator; all must exhaust it) as an HF model
    directory at ``out_dir``, with config and tokenizer files from ``source_dir`` (the run's
    ``model.hf_checkpoint``; a config.json is generated from ``cfg`` when it has none).
    Returns ``out_dir``."""
    out = Path(out_dir)
    world = dist.get_world_size() if dist.is_initialized() else 1
    writer_rank = world == 1 or dist.get_rank() == 0
    # rank 0 makes a fresh ".<name>.tmp-*" beside out (creating the parent) and every
    # rank learns its name
    tmp = _shared_tmp_dir(out) if dist.is_initialized() else _tmp_dir_for(out)
    start = time.perf_counter()
    try:
        writer = _ShardWriter(tmp, max_shard_bytes) if writer_rank else None
        for name, tensor in pairs:
            if writer is not None:
                writer.add([(name, tensor.detach().to("cpu", copy=True))])
        if writer is not None:
            files = writer.finish()
            _write_hf_side_files(tmp, Path(source_dir) if source_dir else tmp / "none", cfg)
            (tmp / EXPORT_INFO).write_text(json.dumps(
                {"step": step, "source": str(source_dir) if source_dir else None,
                 "written": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, indent=1) + "\n")
        _publish_collectively(tmp, out, overwrite=True)  # the old copy goes only once the new is in place
        if writer_rank:
            _say(progress, f"[export-hf] step {step}: {out} ({', '.join(files)}, "
                           f"{writer.total / 1e6:.1f} MB, {time.perf_counter() - start:.1f} s)")
        return out
    except BaseException:
        if writer_rank:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
