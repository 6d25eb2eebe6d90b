"""Benchmark: one vLLM reload per weight sync against one reload per bucket (issue 39).

What is timed (one process, CPU, the trainer at TP=1 beside an in-process vLLM engine,
random weights of a real model's shape): ``WeightBridge.sync()`` with verification
on, its buckets delivered to the engine in one of two ways, side by side on the same engine
and model (the two alternate, repeat by repeat; every sync follows a change of every
trainer weight):

  per_bucket   the path before: each bucket is a vLLM reload of its own
               (``grpo_mega_update`` with ``finish=True``). A reload sets every layer of
               the model aside and, when it closes, puts back each layer its bucket did
               not hold, logging "Failed to load weights" for each: B whole-model passes.
  one_reload   the path now (``RolloutEngine.update_weights``): the buckets feed one
               reload, closed once after the last bucket.

Reported per path: the median sync seconds, the engine's part of it, the bucket count and
the "Failed to load weights" lines that vLLM logged per sync (at WARNING).

Shapes (built locally, no hub access; tied embeddings as the real models):
  135m  SmolLM-135M's: llama, 30 layers, hidden 576, 9 heads / 3 KV heads, MLP 1536, vocab 49152
  1b    Llama-3.2-1B's: llama, 16 layers, hidden 2048, 32 / 8 heads, MLP 8192, vocab 128256,
        in bfloat16 (trainer and engine; float32 needed over 16 GiB of RAM): check ``free -g``

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_reload_per_sync.py --sizes 135m,1b --repeats 3

Not a test: numbers depend on the machine and its load (printed with the load average).
"""
from __future__ import annotations

import logging
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_weight_sync as W  # noqa: E402  (sets the CPU engine's environment, puts REPO on sys.path)

SIZES = {
    "135m": dict(family="llama", tie=True, vocab_size=49152, hidden_size=576, num_layers=30,
                 num_heads=9, num_kv_heads=3, intermediate_size=1536),
    # bf16 (trainer and engine): in float32 the trainer, the engine and vLLM's prepack held
    # 16 GiB at once and the run was killed on this 23 GiB machine
    "1b": dict(family="llama", tie=True, vocab_size=128256, hidden_size=2048, num_layers=16,
               num_heads=32, num_kv_heads=8, intermediate_size=8192, dtype="bfloat16"),
}
PATHS = ("per_bucket", "one_reload")


class PerBucketReload:
    """The path before, as a rollout engine: every bucket a closed vLLM reload of its own."""

    def __init__(self, engine):
        self.engine = engine

    def update_weights(self, named_tensors):
        tensors = [(n, t.detach()) for n, t in named_tensors]
        self.engine.llm.collective_rpc("grpo_mega_update", args=(tensors, True))

    def reset_prefix_cache(self):
        self.engine.reset_prefix_cache()

    def probe(self, specs):
        return self.engine.probe(specs)


class FallbackLines(logging.Handler):
    """Counts vLLM's "Failed to load weights" records (WARNING)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record):
        self.count += "Failed to load weights" in record.getMessage()


def bench_size(name: str, root: Path, repeats: int, bucket_mb: float) -> dict:
    import torch

    from grpo_mega.bridge import WeightBridge

    shape = dict(SIZES[name])
    dtype = shape.pop("dtype", None)
    hf_dir, cfg, ps, model = W.trainer(shape, root, dtype)
    params = sum(p.numel() for p in model.parameters())
    engine = W._engine(hf_dir, dtype)
    engines = {"per_bucket": PerBucketReload(engine), "one_reload": engine}
    bridges = {p: WeightBridge(model, cfg, ps, [engines[p]], bucket_bytes=int(bucket_mb * 2**20))
               for p in PATHS}
    lines = FallbackLines()
    logging.getLogger("vllm").addHandler(lines)
    for p in PATHS:
        bridges[p].sync()  # warm-up
    runs: dict[str, list] = {p: [] for p in PATHS}
    for _ in range(repeats):
        for p in PATHS:
            with torch.no_grad():  # new weights, as after an optimizer step
                for w in model.parameters():
                    w.mul_(1.0001)
            before, start = lines.count, time.perf_counter()
            stats = bridges[p].sync()
            runs[p].append((time.perf_counter() - start, stats.engine_seconds, lines.count - before,
                            stats.buckets, stats.bytes))
    engine.shutdown()
    res = {"size": name, "params": params, "bucket_mb": bucket_mb, "dtype": dtype or "float32"}
    for p in PATHS:
        res[p] = {"sync_s": statistics.median(r[0] for r in runs[p]),
                  "engine_s": statistics.median(r[1] for r in runs[p]),
                  "failed_to_load_lines": max(r[2] for r in runs[p]),
                  "buckets": runs[p][-1][3], "bytes": runs[p][-1][4]}
    return res


def _report(res: dict) -> None:
    old, new = res["per_bucket"], res["one_reload"]
    print(f"[bench] {res['size']}: {res['params'] / 1e6:.0f}M params ({res['dtype']}), {new['bytes'] / 1e6:.0f} MB in "
          f"{new['buckets']} buckets of {res['bucket_mb']:g} MiB", flush=True)
    for p in PATHS:
        r = res[p]
        print(f"  {p:11s} sync {r['sync_s']:7.3f} s (engine {r['engine_s']:7.3f} s), "
              f"'Failed to load weights' lines per sync: {r['failed_to_load_lines']}", flush=True)
    print(f"  one_reload / per_bucket: sync x{new['sync_s'] / old['sync_s']:.2f}, "
          f"engine x{new['engine_s'] / old['engine_s']:.2f}", flush=True)


def main(argv=None) -> int:
    return W.main_over_sizes(argv, doc=__doc__, sizes=SIZES, default="135m,1b", bench_one=bench_size,
                             report=_report, script=__file__)


if __name__ == "__main__":
    sys.exit(main())
