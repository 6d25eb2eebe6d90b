"""Benchmark: weight sync trainer -> vLLM through the bridge vs the naive baseline.

What is timed (one process, CPU, float32, trainer at TP=1 next to an in-process engine):
  bridge          WeightBridge.sync(): export HF tensors from the megatron model in
                  buckets, reload_weights in place, reset the prefix cache, verify
                  (verification also reported on its own)
  bridge_shm      the same through safetensors files in /dev/shm (the path an engine in
                  another process takes), verification off
  naive_rebuild   save an HF checkpoint to disk, then build a new engine from it
  naive_reload    save an HF checkpoint to disk, then reload_weights(weights_path=...)
Each is the median of --repeats runs; GB/s = HF bytes moved / seconds.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_weight_sync.py            # tiny + ~100M
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_weight_sync.py --sizes tiny --repeats 5

Not a test: numbers depend on the machine and its load (print them with the load average).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SIZES = {
    # name: write_hf_checkpoint kwargs
    "tiny": dict(family="qwen2", tie=True, vocab_size=300, hidden_size=128, num_layers=2,
                 num_heads=4, num_kv_heads=2, intermediate_size=192),
    "100m": dict(family="llama", tie=True, vocab_size=32000, hidden_size=768, num_layers=12,
                 num_heads=12, num_kv_heads=4, intermediate_size=2048),
}


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _engine(hf_dir: Path, dtype: str | None = None):
    """The trainer's rollout engine, in-process, on a tokenizer-less checkpoint (``dtype``:
    ``EngineConfig.dtype``, None: float32 on CPU)."""
    from grpo_mega.rollout import EngineConfig, RolloutEngine

    return RolloutEngine(EngineConfig(str(hf_dir), mode="inprocess", max_model_len=64, warmup=False,
                                      dtype=dtype, extra={"skip_tokenizer_init": True}))


def _save_hf(model, cfg, ps, src: Path, out: Path) -> None:
    """The naive path: the whole HF state dict to a checkpoint directory on disk."""
    from safetensors.torch import save_file

    from grpo_mega.bridge import export_hf_weights

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    state = {n: t.contiguous() for n, t in export_hf_weights(model, cfg, ps)}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    shutil.copyfile(src / "config.json", out / "config.json")
    os.sync()  # a checkpoint is on disk only once written back


def trainer(shape: dict, root: Path, dtype: str | None = None):
    """(hf_dir, cfg, ps, model): a random HF checkpoint of ``shape`` (``write_hf_checkpoint``
    keyword arguments, ``family`` among them) written to ``root/hf`` and loaded into a
    megatron model at TP=1 (in ``dtype``, None: the checkpoint's), in a world of one process."""
    import dataclasses

    import torch

    from grpo_mega.checkpoint import convert
    from grpo_mega.distributed.state import init_parallel
    from grpo_mega.models import build_model
    from tests.scripts.bridge_fixtures import write_hf_checkpoint

    kw = dict(shape)
    hf_dir = write_hf_checkpoint(root / "hf", kw.pop("family"), **kw)
    cfg = convert.read_model_config(hf_dir)
    if dtype is not None:
        cfg = dataclasses.replace(cfg, dtype=dtype)
    if not torch.distributed.is_initialized():  # file rendezvous, no port to race for
        torch.distributed.init_process_group("gloo", init_method=f"file://{root / 'world'}",
                                             rank=0, world_size=1)
    ps = init_parallel(1, 1)
    model = build_model(cfg, ps)
    convert.load_hf_weights(model, hf_dir, ps, cfg)
    return hf_dir, cfg, ps, model


def bench_size(name: str, root: Path, repeats: int, bucket_mb: float) -> dict:
    import torch

    from grpo_mega.bridge import WeightBridge

    hf_dir, cfg, ps, model = trainer(SIZES[name], root / name)
    params = sum(p.numel() for p in model.parameters())

    start = time.perf_counter()
    engine = _engine(hf_dir)
    first_engine = time.perf_counter() - start
    bridge = WeightBridge(model, cfg, ps, [engine], bucket_bytes=int(bucket_mb * 2**20))
    bridge.sync()  # warm up
    with torch.no_grad():  # weights change between syncs, as after optimizer steps
        for p in model.parameters():
            p.mul_(1.0001)

    stats = []
    sync_s = _median_time(lambda: stats.append(bridge.sync()), repeats)
    verify_s = statistics.median(s.verify_seconds for s in stats)
    nbytes = stats[-1].bytes
    shm_bridge = WeightBridge(model, cfg, ps, [engine], bucket_bytes=int(bucket_mb * 2**20), verify=False)
    engine.weight_transport = "file"  # what a child-process engine does, timed on this one
    shm_s = _median_time(shm_bridge.sync, repeats)
    engine.weight_transport = "tensors"

    ckpt = root / name / "naive"
    save_s = _median_time(lambda: _save_hf(model, cfg, ps, hf_dir, ckpt), repeats)
    reload_s = _median_time(lambda: engine.llm.collective_rpc(
        "reload_weights", kwargs={"weights_path": str(ckpt)}), repeats)
    rebuild = []

    def rebuild_once():
        start = time.perf_counter()
        new = _engine(ckpt)
        rebuild.append(time.perf_counter() - start)
        new.shutdown()

    for _ in range(max(1, min(repeats, 2))):  # an engine start is slow; 2 are enough
        rebuild_once()
    rebuild_s = statistics.median(rebuild)
    engine.shutdown()

    res = {
        "size": name, "params": params, "hf_bytes": nbytes, "buckets": stats[-1].buckets,
        "first_engine_start_s": first_engine,
        "bridge_export_s": statistics.median(s.export_seconds for s in stats),
        "bridge_engine_s": statistics.median(s.engine_seconds for s in stats),
        "bridge_s": sync_s, "bridge_verify_s": verify_s, "bridge_no_verify_s": sync_s - verify_s,
        "bridge_gbps": nbytes / sync_s / 1e9, "bridge_shm_s": shm_s, "bridge_shm_gbps": nbytes / shm_s / 1e9,
        "naive_save_s": save_s, "naive_reload_s": save_s + reload_s, "naive_rebuild_s": save_s + rebuild_s,
    }
    res["speedup_vs_rebuild"] = res["naive_rebuild_s"] / sync_s
    res["speedup_vs_disk_reload"] = res["naive_reload_s"] / sync_s
    return res


def _report(res: dict) -> None:
    print(f"[bench] {res['size']}: {res['params'] / 1e6:.1f}M params, {res['hf_bytes'] / 1e6:.1f} MB in "
          f"{res['buckets']} bucket(s) | bridge {res['bridge_s']:.3f} s ({res['bridge_gbps']:.2f} GB/s; "
          f"verify {res['bridge_verify_s']:.3f} s) | bridge via /dev/shm {res['bridge_shm_s']:.3f} s | "
          f"naive: disk save {res['naive_save_s']:.2f} s, + reload_weights(path) = "
          f"{res['naive_reload_s']:.2f} s, + engine rebuild = {res['naive_rebuild_s']:.2f} s | "
          f"speedup x{res['speedup_vs_rebuild']:.0f} vs rebuild, x{res['speedup_vs_disk_reload']:.1f} "
          f"vs disk reload", flush=True)


def main_over_sizes(argv, *, doc: str, sizes: dict, default: str, bench_one, report, script: str) -> int:
    """The command line of a benchmark over model sizes: each size runs in a process of its
    own (``--one``; engines and process groups do not survive a second size in one process),
    ``bench_one(name, root, repeats, bucket_mb)`` returns its results, ``report`` prints them."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=default, help=f"comma list of {sorted(sizes)}")
    ap.add_argument("--repeats", type=int, default=3, help="runs per measurement (median)")
    ap.add_argument("--bucket-mb", type=float, default=256.0, help="bridge bucket size (MiB)")
    ap.add_argument("--out", default=None, help="also write the results as JSON here")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: one size, this process
    args = ap.parse_args(argv)
    if args.one:
        root = Path(tempfile.mkdtemp(prefix=f"{Path(script).stem}_"))
        try:
            res = bench_one(args.one, root, args.repeats, args.bucket_mb)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        Path(args.out).write_text(json.dumps(res))
        return 0
    import subprocess

    results = []
    for name in args.sizes.split(","):
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            subprocess.run([sys.executable, script, "--one", name, "--repeats", str(args.repeats),
                            "--bucket-mb", str(args.bucket_mb), "--out", f.name], check=True,
                           stdout=subprocess.DEVNULL)
            results.append(json.loads(Path(f.name).read_text()))
        report(results[-1])
    print(f"[bench] load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


def main(argv=None) -> int:
    return main_over_sizes(argv, doc=__doc__, sizes=SIZES, default="tiny,100m", bench_one=bench_size,
                           report=_report, script=__file__)


if __name__ == "__main__":
    sys.exit(main())
