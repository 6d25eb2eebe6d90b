"""Benchmark: an engine's paused time per in-flight weight update against copying the same bytes.

What is timed (CPU, float32, E engine servers of ``grpo_mega.rollout.remote`` on a model of
``bench_weight_sync.SIZES``), each the median of --repeats updates, every one of them pushed
while a batch of requests is in flight (the requests wait with their KV cache and finish
afterwards):

  paused          on the engine: first bucket header -> stepping resumes (what the requests
                  in flight lose); the slowest engine's
  transfer        on the engine: receiving the buckets over the weights group (gloo broadcast
                  of flat per-dtype buffers)
  load            on the engine: ``RolloutEngine.update_weights`` (vLLM's reload_weights and
                  repacks) of the received tensors
  controller      on the controller: first ``update_weights`` call -> commit acknowledged
  floor           ``dst.copy_(src)`` of every tensor into preallocated buffers (the floor of
                  ``bench_sync_floor.py``): moving those bytes once on this machine

The peers' end-to-end swap (pause included) is about 4-9x their copy time.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_inflight_update.py --size tiny --repeats 5
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_inflight_update.py --size 100m --repeats 3
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_weight_sync as W  # noqa: E402  (puts REPO on sys.path, sets the CPU engine's environment)


def buckets(tensors: dict, bucket_bytes: int) -> list[list]:
    """Whole decoder layers (fused q/k/v and gate/up stay together) packed up to
    ``bucket_bytes``; embeddings and the final norm in their own units."""
    units: dict[str, list] = {}
    for name, t in tensors.items():
        key = ".".join(name.split(".")[:3]) if ".layers." in name else name
        units.setdefault(key, []).append((name, t))
    out, cur, size = [], [], 0
    for unit in units.values():
        n = sum(t.numel() * t.element_size() for _, t in unit)
        if cur and size + n > bucket_bytes:
            out.append(cur)
            cur, size = [], 0
        cur += unit
        size += n
    return out + ([cur] if cur else [])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="tiny", choices=sorted(W.SIZES))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--engines", type=int, default=1)
    ap.add_argument("--bucket-mb", type=float, default=256.0)
    ap.add_argument("--prompts", type=int, default=4, help="prompts in flight (n=2 samples each)")
    args = ap.parse_args(argv)
    os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the servers' engines set their own

    import torch
    from safetensors.torch import load_file

    from grpo_mega.rollout import EngineConfig, SamplingConfig
    from grpo_mega.rollout.remote import RemoteEngines
    from tests.scripts.bridge_fixtures import write_hf_checkpoint

    root = Path(tempfile.mkdtemp(prefix="bench_inflight_"))
    kw = dict(W.SIZES[args.size])
    hf_dir = write_hf_checkpoint(root / "hf", kw.pop("family"), **kw)
    tensors = load_file(str(hf_dir / "model.safetensors"))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    parts = buckets(tensors, int(args.bucket_mb * 2**20))
    dst = {n: torch.empty_like(t) for n, t in tensors.items()}

    def floor():
        for n, t in tensors.items():
            dst[n].copy_(t)

    sampling = SamplingConfig(n=2, temperature=1.0, max_new_tokens=48, ignore_eos=True, seed=0)
    prompts = [[5 + i, 17, 42, 99, 7, 3] for i in range(args.prompts)]
    engine = EngineConfig(str(hf_dir), max_model_len=64, warmup=False, extra={"skip_tokenizer_init": True})
    rows = []
    with RemoteEngines(engine, sampling, engines=args.engines, timeout_s=300) as remote:
        for r in range(args.repeats):
            new = {n: t * (1.0 + 1e-4 * (r + 1)) for n, t in tensors.items()}
            base = sum(e["tokens"] for e in remote.stats()["engines"])
            ticket = remote.submit(prompts, step=r)
            while sum(e["tokens"] for e in remote.stats()["engines"]) < base + 4 * len(prompts):
                time.sleep(0.001)  # every request is a couple of tokens in
            for bucket in buckets(new, int(args.bucket_mb * 2**20)):
                remote.update_weights(bucket)
            per_engine = remote.commit()
            batch = remote.collect(ticket)
            mixed = sum(len(set(v)) > 1 for v in batch.versions)
            worst = max(per_engine, key=lambda u: u["paused_s"])
            rows.append(dict(paused=worst["paused_s"], transfer=worst["transfer_s"], load=worst["load_s"],
                             controller=remote.updates[-1]["controller_s"], mixed=mixed, samples=len(batch),
                             in_flight=min(u["in_flight"] for u in per_engine)))
    floor_s = W._median_time(floor, max(3, args.repeats))
    print(f"[bench] {args.size}: {total / 1e6:.1f} MB of HF tensors ({len(tensors)} tensors, {len(parts)} "
          f"buckets), {args.engines} engine(s), median of {args.repeats} in-flight updates, load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    for k in ("paused", "transfer", "load", "controller"):
        v = statistics.median(row[k] for row in rows)
        print(f"  {k:11s} {v:8.4f} s  {total / v / 1e9:6.2f} GB/s  {v / floor_s:7.2f}x floor")
    print(f"  {'floor':11s} {floor_s:8.4f} s  {total / floor_s / 1e9:6.2f} GB/s")
    print(f"  requests in flight at every update: {all(r['in_flight'] for r in rows)}; samples spanning "
          f"two versions: {sum(r['mixed'] for r in rows)} of {sum(r['samples'] for r in rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
