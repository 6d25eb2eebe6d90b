"""Benchmark: bytes and seconds per weight sync, full fine-tuning vs LoRA merged vs LoRA adapter.

What is timed (one process, CPU, float32, trainer at TP=1 next to in-process vLLM engines),
each a ``WeightBridge.sync()`` with verification on, after the weights changed:
  full     a model without adapters: every HF tensor into a plain engine (today's sync)
  merged   the same model with LoRA adapters (``model.lora.sync: merged``): every HF tensor,
           adapted ones as W + scale * B A, into the plain engine
  adapter  the LoRA model's adapter alone, in PEFT names, into an engine started with LoRA
           (``model.lora.sync: adapter``: written as a PEFT directory in /dev/shm and loaded
           with vLLM's ``add_lora``)
Each row: MB sent, the median seconds of --repeats syncs, split into export (gather + map),
engine (load) and verify. Adapters: rank --rank on every linear (qkv, proj, fc1, fc2).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_lora_sync.py                 # tiny + ~100M
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_lora_sync.py --sizes 100m --repeats 5
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_lora_sync.py --smoke          # tiny, 1 repeat

Not a test (the suite runs --smoke only): numbers depend on the machine and its load.
"""
from __future__ import annotations

import statistics
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_weight_sync as W  # noqa: E402  (puts REPO on sys.path, sets the CPU engine's environment)

RANK = 16
MODES = ("full", "merged", "adapter")


def _timed_syncs(bridge, model, repeats: int) -> dict:
    """Median figures of ``repeats`` syncs, the trainable weights nudged before each."""
    import torch

    trainable = [p for p in model.parameters() if p.requires_grad]
    stats = []
    for _ in range(repeats):
        with torch.no_grad():  # as after an optimizer step
            for p in trainable:
                p.add_(1e-3)
        stats.append(bridge.sync())
    med = {k: statistics.median(getattr(s, k) for s in stats)
           for k in ("seconds", "export_seconds", "engine_seconds", "verify_seconds")}
    return {"bytes": stats[-1].bytes, "tensors": stats[-1].tensors,
            "verified": min(s.verified_tensors for s in stats), **med}


def bench_size(name: str, root: Path, repeats: int, bucket_mb: float, rank: int = RANK) -> dict:
    from grpo_mega.bridge import WeightBridge
    from grpo_mega.rollout import EngineConfig, RolloutEngine
    from tests.scripts.lora_fixtures import lora_config, lora_model

    hf_dir, cfg, ps, model = W.trainer(W.SIZES[name], root / name)
    lcfg = lora_config(cfg, rank=rank, alpha=2.0 * rank, sync="merged")
    lmodel = lora_model(lcfg, ps, hf_dir)
    bucket = int(bucket_mb * 2**20)
    rows = {"size": name, "params": sum(p.numel() for p in model.parameters()), "rank": rank,
            "adapter_params": sum(p.numel() for p in lmodel.parameters() if p.requires_grad)}
    engine = W._engine(hf_dir)
    full = WeightBridge(model, cfg, ps, [engine], bucket_bytes=bucket)
    full.sync()  # warm up
    rows["full"] = _timed_syncs(full, model, repeats)
    rows["merged"] = _timed_syncs(WeightBridge(lmodel, lcfg, ps, [engine], bucket_bytes=bucket), lmodel, repeats)
    engine.shutdown()
    lora_engine = RolloutEngine(EngineConfig(str(hf_dir), mode="inprocess", max_model_len=64, warmup=False,
                                             lora_rank=rank, extra={"skip_tokenizer_init": True}))
    adapter = WeightBridge(lmodel, lcfg, ps, [lora_engine], bucket_bytes=bucket, lora_sync="adapter")
    adapter.sync()  # warm up
    rows["adapter"] = _timed_syncs(adapter, lmodel, repeats)
    lora_engine.shutdown()
    return rows


def _report(res: dict) -> None:
    full = res["full"]
    print(f"[bench] {res['size']}: {res['params'] / 1e6:.1f}M params, LoRA rank {res['rank']} "
          f"({res['adapter_params'] / 1e6:.2f}M adapter params)", flush=True)
    for mode in MODES:
        r = res[mode]
        print(f"[bench]   {mode:8s} {r['bytes'] / 1e6:9.2f} MB  {r['seconds']:7.3f} s  (export "
              f"{r['export_seconds']:.3f}, engine {r['engine_seconds']:.3f}, verify {r['verify_seconds']:.3f})"
              f"  bytes x{r['bytes'] / full['bytes']:.4f}, time x{r['seconds'] / full['seconds']:.2f} of full",
              flush=True)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--smoke" in argv:  # one tiny run in this process (the suite's check that it runs)
        root = Path(tempfile.mkdtemp(prefix="bench_lora_sync_"))
        res = bench_size("tiny", root, repeats=1, bucket_mb=256.0, rank=8)
        _report(res)
        if "--json" in argv:  # the suite runs the smoke in a process of its own and reads this
            Path(argv[argv.index("--json") + 1]).write_text(json.dumps(res))
        return res
    return W.main_over_sizes(argv, doc=__doc__, sizes=W.SIZES, default="tiny,100m", bench_one=bench_size,
                           report=_report, script=__file__)


if __name__ == "__main__":
    out = main()
    sys.exit(out if isinstance(out, int) else 0)
