"""Verification of a weight sync: probe specs, and the engines' readings compared with them.

What: for every HF tensor sent, a :class:`Probe` keeps the slice the engine must
hold (k random columns of each matrix, fresh each sync; k random vocabulary rows
of the embedding / lm_head plus the hidden columns at which every kernel using
them is probed, a tied lm_head included; all of every 1-D tensor). The engine
answers ``probe(specs)`` (``RolloutEngineProtocol``; vLLM's side is
``grpo_mega.rollout.worker.probe_weights``: fused names and TP shards are
resolved inside the worker). Comparison is bitwise by default, after casting
the trainer's values to the engine's dtype. Why probe kernels rather than
parameters: vLLM's CPU layers keep prepacked copies that can go stale on their
own (a tied lm_head after ``reload_weights``).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Optional

import torch

from grpo_mega.bridge.export import DTYPES
from grpo_mega.config import ModelConfig
from grpo_mega.models import hf as mapping

__all__ = ["Probe", "make_probe", "verify_engine", "make_adapter_probes", "verify_adapter"]


@dataclass
class Probe:
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


def make_probe(name: str, t: torch.Tensor, cfg: ModelConfig, k: int, seed: int) -> Probe:
    if t.ndim == 1:
        return Probe(None, None, t.detach().to("cpu", copy=True))
    # Columns depend on the sync and the input width only, so q, k and v (gate and up)
    # share them and the worker runs each fused kernel once.
    gen = torch.Generator().manual_seed(seed ^ t.shape[1])
    cols = sorted(torch.randperm(t.shape[1], generator=gen)[:k].tolist())
    if mapping.is_vocab_hf_name(name, cfg):
        gen = torch.Generator().manual_seed(seed ^ zlib.crc32(name.encode()))
        rows = sorted(torch.randperm(t.shape[0], generator=gen)[:k].tolist())
        return Probe(rows, None, t[rows].detach().to("cpu"), kernel_cols=cols)
    return Probe(None, cols, t[:, cols].detach().to("cpu"))


def _positions(held: Optional[list[int]], want: Optional[list[int]]):
    """Index into an expected axis (``want``: its global indices, None = all) of the
    global indices ``held`` (None = all of them)."""
    if held is None:
        return slice(None)
    if want is None:
        return list(held)
    return [want.index(i) for i in held]


def _compare(name: str, probe: Probe, reading: dict, engine_dtype: torch.dtype, atol: float
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


def verify_engine(engine, probes: dict[str, Probe], atol: float = 0.0) -> list[str]:
    """Compare the engine's weights with ``probes``; returns mismatch descriptions."""
    results = engine.probe([p.spec(n) for n, p in probes.items()])
    problems, seen = [], set()
    for res in results:
        dtype = DTYPES.get(res.get("dtype", ""), torch.float32)
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


def _values(v) -> torch.Tensor:
    """A reading's values: a tensor (engine in this process) or the plain
    {"shape", "data"} lists a child-process engine returns."""
    if isinstance(v, torch.Tensor):
        return v.detach().float()
    return torch.tensor(v["data"], dtype=torch.float32).reshape(v["shape"])


def make_adapter_probes(pairs, lora_cfg, k: int, seed: int) -> dict[str, Probe]:
    """``model.lora.sync: adapter``: per HF module of the adapter ``pairs`` (PEFT names),
    k random columns of the update scale * B A the engine must apply (float64 product)."""
    tensors = dict(pairs)
    scale = lora_cfg.alpha / lora_cfg.rank
    probes = {}
    for name, a in tensors.items():
        if not name.endswith(".lora_A.weight"):
            continue
        module = name[:-len(".lora_A.weight")]
        b = tensors[module + ".lora_B.weight"]
        gen = torch.Generator().manual_seed(seed ^ a.shape[1])
        cols = sorted(torch.randperm(a.shape[1], generator=gen)[:k].tolist())
        expected = (b.detach().double().cpu() @ a.detach().double().cpu()[:, cols]) * scale
        probes[module[len("base_model.model."):]] = Probe(None, cols, expected)
    return probes


def verify_adapter(engine, probes: dict[str, Probe], atol: float = 0.0) -> list[str]:
    """Compare the adapter the engine holds (``probe_adapter``) with ``probes``. The engine
    computes its product from its own copy (the scale folded into B, float32), so the
    comparison allows float32 rounding of the product: ``max(atol, 1e-5 * max|expected|)``."""
    results = engine.probe_adapter([(n, p.cols) for n, p in probes.items()])
    problems, seen = [], set()
    for res in results:
        for name, readings in res["probes"].items():
            if name not in probes:
                continue
            seen.add(name)
            exp = probes[name].expected
            tol = max(atol, 1e-5 * float(exp.abs().max()) if exp.numel() else 0.0)
            for reading in readings:
                if "error" in reading:
                    problems.append(f"{name} (adapter): {reading['error']}")
                    continue
                val = _values(reading["values"]).double()
                if tuple(val.shape) != tuple(exp.shape):
                    problems.append(f"{name} (adapter): engine returned shape {tuple(val.shape)}, "
                                    f"expected {tuple(exp.shape)}")
                    continue
                diff = float((val - exp).abs().max()) if val.numel() else 0.0
                if not diff <= tol:  # NaN fails
                    problems.append(f"{name} (adapter): max |engine - trainer| of scale * B A = {diff:.3g} "
                                    f"(tolerance {tol:.3g})")
    problems += [f"{n} (adapter): no engine worker reported it" for n in probes if n not in seen]
    return problems
