"""One launch of 4 gloo ranks that runs every multi-rank check of the bridge and the converter.

A launch costs 10-20 s of imports, so ``launch_once()`` runs it a single time per
pytest session (its xdist workers share it through a file) and both
tests/unit/checkpoint/test_convert.py and tests/unit/bridge/test_sync.py read its report:
{check name: value}, merged over ranks (see ``merged``).

Per model variant (llama tied / untied, qwen2 with QKV bias, qwen3 with QK-norm):
  HF -> mcore (collective, each rank writes a share) -> load at TP1, TP2, PP2, TP2xPP2
  -> export through the bridge (small buckets, PP broadcast) -> compare bitwise with
  the original HF tensors; at TP1 also logits vs transformers; at TP2xPP2 the direct
  HF load must equal the mcore load; then mcore -> HF (collective) compared bitwise.
Bridge at TP2xPP2 with a recording fake engine: each rank returns what its engine
received (tensors, buckets, resets) and the error of a sync in which rank 3's engine
missed a tensor, under the key "bridge"; tests/unit/bridge/test_sync.py asserts on them.
"""
from __future__ import annotations

import atexit
import fcntl
import functools
import os
import shutil
import tempfile
from pathlib import Path

import torch

from tests.scripts.bridge_fixtures import read_hf_tensors, write_hf_checkpoint

VARIANTS = {
    # name: (family, tie_word_embeddings)
    "llama_tied": ("llama", True),
    "llama_untied": ("llama", False),
    "qwen2_bias": ("qwen2", True),
    "qwen3_qknorm": ("qwen3", False),
}
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (tp, pp) at world 4; dp = 4 / (tp * pp)
SMALL_BUCKET = 96 * 1024  # bytes: several buckets per stage for these tiny models
STALE_VICTIM = "model.layers.1.self_attn.v_proj.bias"  # rank 3's engine misses it


class FakeEngine:
    """An engine that stores what it receives and answers probes from it, the way
    ``rollout.worker.probe_weights`` answers for an unsharded vLLM worker."""

    def __init__(self, drop: str | None = None):
        self.store: dict[str, torch.Tensor] = {}
        self.buckets: list[list[str]] = []
        self.bucket_bytes: list[int] = []
        self.resets = 0
        self.drop = drop

    def update_weights(self, named_tensors):
        names = []
        for name, t in named_tensors:
            names.append(name)
            if name != self.drop:
                self.store[name] = t.detach().clone()
        self.buckets.append(names)
        self.bucket_bytes.append(sum(t.numel() * t.element_size() for _, t in named_tensors))

    def reset_prefix_cache(self):
        self.resets += 1

    def probe(self, specs):
        probes = {}
        for name, rows, cols in specs:
            if name not in self.store:
                probes[name] = [{"error": "not loaded"}]
                continue
            w = self.store[name]
            if w.ndim == 1:
                probes[name] = [{"rows": None, "cols": None, "values": w.float()}]
            elif rows is None:
                probes[name] = [{"rows": None, "cols": list(cols), "values": w[:, cols].float()}]
            else:
                probes[name] = [{"rows": list(rows), "cols": None, "values": w[rows].float()},
                                {"rows": list(rows), "cols": list(cols), "values": w[rows][:, cols].float()}]
        return [{"dtype": "torch.float32", "probes": probes}]


def _diff(got: dict, want: dict) -> list[str]:
    """Names that are missing, extra, or not bitwise equal (dtype and shape included)."""
    bad = [f"missing {n}" for n in want if n not in got] + [f"extra {n}" for n in got if n not in want]
    for n in want:
        if n in got and (got[n].dtype != want[n].dtype or not torch.equal(got[n].cpu(), want[n])):
            bad.append(f"differs {n}")
    return bad


def _reinit(tp: int, pp: int):
    from megatron.core import parallel_state as mpu

    from grpo_mega.distributed.state import init_parallel

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    return init_parallel(tp, pp, seed=3)


def _transformers_logits_diff(hf_dir: Path, model, cfg) -> float:
    from transformers import AutoModelForCausalLM

    from grpo_mega.models import forward_logits

    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = forward_logits(model, tokens)[..., :cfg.vocab_size]
        return float((ours - hf(tokens).logits).abs().max())


def _variant_checks(rank: int, root: Path, vname: str, report: dict) -> None:
    from grpo_mega.checkpoint import convert
    from grpo_mega.bridge import export_hf_weights
    from grpo_mega.models import build_model

    hf_dir, mc, back = root / vname / "hf", root / vname / "mcore", root / vname / "back"
    original = read_hf_tensors(hf_dir)
    cfg = convert.read_model_config(hf_dir)
    _reinit(1, 1)
    convert.hf_to_mcore(hf_dir, mc, progress=None)
    for tp, pp in LAYOUTS:
        ps = _reinit(tp, pp)
        model = build_model(cfg, ps)
        convert.load_mcore_weights(model, mc, ps)
        exported = dict(export_hf_weights(model, cfg, ps, bucket_bytes=SMALL_BUCKET))
        report[f"export {vname} tp{tp} pp{pp}"] = _diff(exported, original)
        if (tp, pp) == (1, 1) and rank == 0:
            report[f"logits {vname}"] = _transformers_logits_diff(hf_dir, model, cfg)
        if (tp, pp) == (2, 2):
            direct = build_model(cfg, ps)
            convert.load_hf_weights(direct, hf_dir, ps, cfg)
            same = all(torch.equal(a, b) for a, b in zip(model.parameters(), direct.parameters()))
            report[f"hf_load_equals_mcore_load {vname}"] = same
    convert.mcore_to_hf(mc, back, progress=None)
    if rank == 0:
        report[f"roundtrip {vname}"] = _diff(read_hf_tensors(back), original)


def _bridge_checks(rank: int, root: Path, report: dict) -> None:
    from grpo_mega.checkpoint import convert
    from grpo_mega.models.hf_config import model_config_from_hf
    from grpo_mega.bridge import WeightBridge, WeightSyncError
    from grpo_mega.models.hf import ShapeMismatchError
    from grpo_mega.models import build_model

    vname = "qwen2_bias"
    hf_dir = root / vname / "hf"
    cfg = convert.read_model_config(hf_dir)
    ps = _reinit(2, 2)
    model = build_model(cfg, ps)
    convert.load_hf_weights(model, hf_dir, ps, cfg)
    original = read_hf_tensors(hf_dir)

    # Raw results only: tests/unit/bridge/test_sync.py makes the assertions.
    engine = FakeEngine()
    bridge = WeightBridge(model, cfg, ps, [engine], bucket_bytes=SMALL_BUCKET)
    stats = bridge.sync()
    result = {"received": engine.store, "resets": engine.resets, "verified": stats.verified_tensors,
              "buckets": engine.buckets, "bucket_bytes": engine.bucket_bytes}
    if rank == 0:
        result.update(original=original, cfg=cfg, small_bucket=SMALL_BUCKET)

    # Train-free staleness: change the weights, then let rank 3's engine miss one tensor.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    bridge.engines = [FakeEngine(drop=STALE_VICTIM if rank == 3 else None)]
    try:
        bridge.sync()
        result["stale error"] = None
    except WeightSyncError as e:
        result["stale error"] = str(e)
    report["bridge"] = result

    # A conversion that fails half-way must leave neither output nor temporary directory.
    import grpo_mega.checkpoint.convert as conv

    real, calls = conv.mapping.hf_to_canonical, []

    def failing(name, tensors, cfg):
        calls.append(name)
        if len(calls) == 1:  # every rank converts at least one tensor, so all fail together
            raise RuntimeError("injected failure")
        return real(name, tensors, cfg)

    conv.mapping.hf_to_canonical = failing
    out = root / "failed" / "mcore"
    try:
        conv.hf_to_mcore(hf_dir, out, progress=None)
        report["failed conversion"] = "not raised"
    except RuntimeError as e:
        report["failed conversion"] = str(e)
    finally:
        conv.mapping.hf_to_canonical = real
    torch.distributed.barrier()
    report["failed conversion leftovers"] = sorted(p.name for p in (root / "failed").iterdir())

    # A checkpoint whose shapes do not fit the model's config.
    wrong = model_config_from_hf(convert.read_hf_config(hf_dir), ffn_hidden_size=256)
    ps = _reinit(1, 1)
    try:
        convert.load_mcore_weights(build_model(wrong, ps), root / vname / "mcore", ps, wrong)
        report["bad shape"] = "not raised"
    except ShapeMismatchError as e:
        report["bad shape"] = str(e)


LORA_RANK, LORA_ALPHA = 4, 8.0
LORA_LAYOUTS = [(1, 1), (1, 2), (2, 1)]  # resumes of the TP2xPP2 save


def _lora_checks(rank: int, root: Path, report: dict) -> None:
    """LoRA on the qwen2 variant at TP2xPP2 (known adapters, ``lora_fixtures``): the merged and
    the adapter-only exports, a checkpoint (adapters and moments only) resumed at TP1, PP2 and
    TP2, and its PEFT / merged HF export (collective). Raw results under "lora";
    tests/unit/checkpoint/test_lora_checkpoint.py asserts on them."""
    import dataclasses
    import json

    from grpo_mega.bridge import export_hf_weights
    from grpo_mega.bridge.export import export_adapter_buckets
    from grpo_mega.bridge.lora import adapter_canonical
    from grpo_mega.checkpoint import convert, load_checkpoint, save_checkpoint
    from grpo_mega.checkpoint.lora_export import lora_to_peft
    from grpo_mega.config import OptimizerConfig
    from grpo_mega.optim import build_optimizer
    from tests.scripts.lora_fixtures import canonical_adapters, lora_config, lora_model, set_adapters

    hf_dir = root / "qwen2_bias" / "hf"
    cfg = lora_config(convert.read_model_config(hf_dir), rank=LORA_RANK, alpha=LORA_ALPHA)
    cfg = dataclasses.replace(cfg, hf_checkpoint=str(hf_dir))
    canon = canonical_adapters(cfg)
    ps = _reinit(2, 2)
    model = lora_model(cfg, ps, hf_dir)
    set_adapters(model, cfg, ps, canon)
    out: dict = {"merged": dict(export_hf_weights(model, cfg, ps, bucket_bytes=SMALL_BUCKET)),
                 "peft": dict(p for b in export_adapter_buckets(model, cfg, ps, bucket_bytes=SMALL_BUCKET) for p in b)}
    opt = build_optimizer(model, OptimizerConfig(), ps)
    with torch.no_grad(), opt.full_state():
        for p in opt.params:  # moments a known function of their parameter, in every layout
            for k, t in opt.state_tensors(p).items():
                t.copy_(p * (0.5 if k == "exp_avg" else 0.25))
    opt.adam_step = 3.0
    common = json.loads(json.dumps({"model": dataclasses.asdict(cfg)}, default=str))
    ckpt = save_checkpoint(root / "lora_ckpt", 3, model, opt, ps, common)
    out["files"] = sorted(p.name for p in ckpt.iterdir())
    out["bytes"] = sum(p.stat().st_size for p in ckpt.iterdir() if p.suffix == ".distcp")
    from megatron.core import dist_checkpointing
    out["keys"] = sorted(dist_checkpointing.load_tensors_metadata(str(ckpt)))
    for tp, pp in LORA_LAYOUTS:
        ps = _reinit(tp, pp)
        resumed = lora_model(cfg, ps, hf_dir)  # fresh adapters: B = 0
        opt = build_optimizer(resumed, OptimizerConfig(), ps)
        load_checkpoint(ckpt, resumed, opt, ps, cfg)
        got = {n: (a, b) for n, a, b in adapter_canonical(resumed, cfg, ps)}
        with opt.full_state():
            moments = sum(int(not torch.equal(t, p.detach() * (0.5 if k == "exp_avg" else 0.25)))
                          for p in opt.params for k, t in opt.state_tensors(p).items())
        out[f"resume tp{tp} pp{pp}"] = {
            "names": sorted(got), "moments wrong": moments,
            "wrong": [n for n, (a, b) in got.items() if not (torch.equal(a, canon[n][0]) and torch.equal(b, canon[n][1]))],
            "adam_step": opt.adam_step}
    peft_dir = lora_to_peft(ckpt, root / "lora_peft", progress=None)
    merged_dir = lora_to_peft(ckpt, root / "lora_merged", merged=True, progress=None)
    if rank == 0:
        out["peft config"] = json.loads((peft_dir / "adapter_config.json").read_text())
        out["peft files"] = read_hf_tensors(peft_dir)
        out["merged files"] = read_hf_tensors(merged_dir)
    else:
        out = {k: v for k, v in out.items() if k.startswith("resume")}
    report["lora"] = out


def _rank_main(rank: int, world: int, root: str) -> dict:
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import time

    report: dict = {}
    start = time.perf_counter()
    for vname in VARIANTS:
        _variant_checks(rank, Path(root), vname, report)
        report[f"seconds after {vname}"] = time.perf_counter() - start
    _bridge_checks(rank, Path(root), report)
    lora = time.perf_counter()
    _lora_checks(rank, Path(root), report)
    report["lora seconds"] = time.perf_counter() - lora
    report["seconds"] = time.perf_counter() - start
    from grpo_mega.checkpoint.convert import release_checkpoint_writer

    release_checkpoint_writer()  # run_ranks may kill a slow-exiting rank; leave no Manager behind
    return report


def launch_once(tmp_path_factory=None) -> tuple:
    """The per-rank reports of the 4-rank checks, run once per pytest session.

    ``tmp_path_factory``: pytest's; under pytest-xdist the parent of its base temp directory
    is seen by every worker of the session. test_convert.py and test_sync.py run on different
    workers (one file per unit), so without it each worker paid the launch (~35 s); with it
    the first writes its reports there under a lock and the other reads them. The reports
    are plain data (tensors, numbers, strings, a ModelConfig), read back with
    ``weights_only=True``."""
    if tmp_path_factory is None or "PYTEST_XDIST_WORKER" not in os.environ:
        return _launch()
    shared = tmp_path_factory.getbasetemp().parent
    path = shared / "bridge_ranks_reports.pt"
    with open(shared / "bridge_ranks_reports.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also on error
        if path.is_file():
            from grpo_mega.config.model import ModelConfig  # the bridge result's ``cfg``

            with torch.serialization.safe_globals([ModelConfig]):
                return tuple(torch.load(path, weights_only=True))
        reports = _launch()
        torch.save(list(reports), path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)
        return reports


@functools.lru_cache(maxsize=None)
def _launch() -> tuple:
    """Build the HF checkpoints, run the 4-rank checks; returns per-rank reports."""
    from tests.distributed import run_ranks

    root = Path(tempfile.mkdtemp(prefix="grpo_bridge_ranks_"))
    atexit.register(shutil.rmtree, root, True)
    for i, (vname, (family, tie)) in enumerate(VARIANTS.items()):
        write_hf_checkpoint(root / vname / "hf", family, tie=tie, seed=i)
    return tuple(run_ranks(4, _rank_main, str(root), timeout=600, fresh=True))


def merged(reports, key):
    """A check's value from every rank that reported it: {rank: value}."""
    return {r: rep[key] for r, rep in enumerate(reports) if key in rep}
