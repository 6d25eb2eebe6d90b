"""Benchmark: the weight sync's own part against the floor of copying the same bytes.

What is timed (one process, CPU, float32, trainer at TP=1 next to an in-process vLLM
engine, the ~100M-parameter model of ``bench_weight_sync.py``), each the median of
--repeats runs after a warm-up sync, in one run side by side:

  export          ``export_buckets``: megatron parameters -> HF-named full tensors
                  (mapping table, fused q/k/v and gate/up split), every bucket drawn
  probes          the verification's trainer side: ``make_probe`` on every tensor
  verify          the verification's engine side: ``verify_engine`` (probe reads in the
                  worker, comparison)
  file transport  the cross-process transport: the tensors written as a safetensors
                  file in /dev/shm and read back the way the worker reads it (the
                  in-process ``tensors`` transport hands over references: no copy)
  vllm reload     ``engine.update_weights`` of every bucket in the ``tensors`` transport,
                  then ``reset_prefix_cache``: one vLLM reload (its repack) plus the
                  tied-module repack, i.e. the engine's part, not ours
  sync            ``WeightBridge.sync()`` as the trainer runs it (tensors transport,
                  verification on)
  floor           ``dst.copy_(src)`` of every exported tensor into preallocated
                  buffers: the cost of moving those bytes once on this machine

Our part = export + probes + verify (in-process); + file transport for an engine in
another process. The ratio to the floor is printed.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_sync_floor.py --repeats 5
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_weight_sync as W  # noqa: E402  (sets the CPU engine's environment, puts REPO on sys.path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="100m", choices=sorted(W.SIZES))
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)

    import torch

    from grpo_mega.bridge import WeightBridge
    from grpo_mega.bridge.export import export_buckets, nbytes
    from grpo_mega.bridge.verify import make_probe, verify_engine
    from grpo_mega.rollout.worker import write_weight_file

    root = Path(tempfile.mkdtemp(prefix="bench_sync_floor_"))
    hf_dir, cfg, ps, model = W.trainer(W.SIZES[args.size], root)
    params = sum(p.numel() for p in model.parameters())
    engine = W._engine(hf_dir)
    bridge = WeightBridge(model, cfg, ps, [engine])
    bridge.sync()  # warm-up
    with torch.no_grad():  # new weights, as after an optimizer step
        for p in model.parameters():
            p.mul_(1.0001)

    buckets = [list(b) for b in export_buckets(model, cfg, ps)]
    tensors = [(n, t.contiguous()) for b in buckets for n, t in b]
    total = sum(nbytes(b) for b in buckets)
    dst = [torch.empty_like(t) for _, t in tensors]

    def export():
        for b in export_buckets(model, cfg, ps):
            del b

    def probes():
        return {n: make_probe(n, t, cfg, bridge.verify_columns, 1) for n, t in tensors}

    probe_set = probes()

    def file_transport():
        from safetensors import safe_open

        with write_weight_file(tensors) as path, safe_open(path, framework="pt", device="cpu") as f:
            for k in f.keys():
                f.get_tensor(k)

    def floor():
        for d, (_, s) in zip(dst, tensors):
            d.copy_(s)

    stats = []
    r = args.repeats
    res = {
        "floor": W._median_time(floor, r),
        "export": W._median_time(export, r),
        "probes": W._median_time(probes, r),
        "verify": W._median_time(lambda: verify_engine(engine, probe_set, bridge.verify_atol), r),
        "file transport": W._median_time(file_transport, r),
        "vllm reload": W._median_time(lambda: ([engine.update_weights(b) for b in buckets],
                                                engine.reset_prefix_cache()), r),  # closes the reload
        "sync": W._median_time(lambda: stats.append(bridge.sync()), r),
    }
    engine.shutdown()
    ours = res["export"] + res["probes"] + res["verify"]
    print(f"[bench] {args.size}: {params / 1e6:.1f}M params, {total / 1e6:.1f} MB of HF tensors "
          f"({len(tensors)} tensors, {len(buckets)} buckets), median of {r}, load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    for k, v in res.items():
        print(f"  {k:15s} {v:8.4f} s  {total / v / 1e9:6.2f} GB/s  {v / res['floor']:6.2f}x floor")
    print(f"  our part, in-process (export + probes + verify): {ours:.4f} s = {ours / res['floor']:.2f}x floor")
    print(f"  our part, cross-process (+ file transport): {ours + res['file transport']:.4f} s = "
          f"{(ours + res['file transport']) / res['floor']:.2f}x floor")
    print(f"  sync's own split (median): export {statistics.median(s.export_seconds for s in stats):.4f} s, "
          f"engine {statistics.median(s.engine_seconds for s in stats):.4f} s, "
          f"verify {statistics.median(s.verify_seconds for s in stats):.4f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
