"""Hugging Face checkpoint files: lazy tensor reads (single file or sharded with an
index), config.json, the shape check against the family's mapping table, and the
sharded safetensors writer used when exporting to HF."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from grpo_mega.checkpoint.io import CheckpointError
from grpo_mega.config import ModelConfig
from grpo_mega.models import hf as mapping
from grpo_mega.models.hf import MissingTensorError, ShapeMismatchError


HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt",
                 "added_tokens.json", "chat_template.jinja")


# Tensors some HF checkpoints carry that are recomputed, not learned.
_IGNORED_HF = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


class HFReader:
    """Lazy access to an HF checkpoint's tensors (single file or sharded with an index)."""

    def __init__(self, hf_dir: str | os.PathLike):
        from safetensors import safe_open

        self.dir = Path(hf_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()), key=str)
        elif (self.dir / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            raise CheckpointError(f"{self.dir}: no model.safetensors or model.safetensors.index.json")
        root = self.dir.resolve()
        for f in files:
            # A crafted index (or a link) could name any file the trainer can read ("../../x",
            # "/etc/x"): its bytes would load as weights and reach the rollout engine.
            if not isinstance(f, str) or os.path.isabs(f) or not (root / f).resolve().is_relative_to(root):
                raise CheckpointError(f"{self.dir}: the weights file {f!r} lies outside the checkpoint "
                                      "directory (named by model.safetensors.index.json, or a link); refusing to read it")
        self._files = {f: safe_open(str(self.dir / f), framework="pt", device="cpu") for f in files}
        self._where = {k: f for f, h in self._files.items() for k in h.keys()}

    @property
    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def _handle(self, name: str):
        if name not in self._where:
            raise MissingTensorError(f"HF checkpoint {self.dir} has no tensor {name!r}")
        return self._files[self._where[name]]


def read_hf_config(hf_dir: str | os.PathLike) -> dict:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{hf_dir}: no config.json (is this an HF checkpoint directory?)")
    return json.loads(path.read_text())


def check_hf_checkpoint(reader: HFReader, cfg: ModelConfig) -> None:
    """Every tensor the config implies exists with the implied shape, and nothing else
    (besides rotary caches and a tied lm_head copy); errors name tensor and shapes."""
    expected = {}
    for name in mapping.canonical_names(cfg):
        expected.update(zip(mapping.hf_names_for(name, cfg), mapping.hf_shapes(name, cfg)))
    for hf_name, want in expected.items():
        got = reader.shape(hf_name)  # raises MissingTensorError naming it
        if got != want:
            raise ShapeMismatchError(f"{hf_name}: checkpoint shape {got} != expected {want} from "
                                     f"config.json ({mapping.config_summary(cfg)})")
    extra = [n for n in reader.names if n not in expected and not _IGNORED_HF.search(n)
             and not (n == "lm_head.weight" and cfg.tie_embeddings)]
    if extra:
        raise CheckpointError(f"{reader.dir}: tensors not in the {cfg.family} mapping table: {extra[:10]}")


class _ShardWriter:
    """HF safetensors output in shards of at most ``max_bytes`` (plus an index when >1)."""

    def __init__(self, out: Path, max_bytes: int):
        self.out, self.max_bytes = out, max_bytes
        self.pending: list = []
        self.files: list[tuple[str, list[str]]] = []
        self.total = 0

    def add(self, pairs) -> None:
        for name, t in pairs:
            n = t.numel() * t.element_size()
            if self.pending and sum(x.numel() * x.element_size() for _, x in self.pending) + n > self.max_bytes:
                self.flush()
            self.pending.append((name, t))
            self.total += n

    def flush(self) -> None:
        from grpo_mega.common.safetensors_io import write_safetensors

        if not self.pending:
            return
        name = f"part-{len(self.files):05d}.safetensors"
        # safetensors orders tensors by name; HF readers do not care, but keep files tidy
        pairs = sorted(self.pending, key=lambda p: p[0])
        write_safetensors(str(self.out / name), [(n, t.contiguous()) for n, t in pairs],
                          metadata={"format": "pt"})
        self.files.append((name, [n for n, _ in pairs]))
        self.pending = []

    def finish(self) -> list[str]:
        self.flush()
        if len(self.files) == 1:
            os.rename(self.out / self.files[0][0], self.out / "model.safetensors")
            return ["model.safetensors"]
        n, weight_map, names = len(self.files), {}, []
        for k, (tmp_name, tensors) in enumerate(self.files):
            final = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
            os.rename(self.out / tmp_name, self.out / final)
            weight_map.update({t: final for t in tensors})
            names.append(final)
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return names
