"""Measure the rollout engine on a tiny model: startup, tokens/s, update_weights.

    OMP_NUM_THREADS=1 .venv/bin/python tests/scripts/rollout_bench.py [--mode inprocess|child]
        [--prompts 64] [--n 8] [--new-tokens 32] [--hidden 128] [--layers 2]

Single process (no torch.distributed). In child mode it also reports the CPU
time the idle engine-core process burns while the trainer would be working.
Prints one JSON line. The work sits under the __main__ guard because the
child engine re-imports this module.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="inprocess", choices=["inprocess", "child"])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=1.0)
    args = ap.parse_args()

    from safetensors.torch import load_file

    from grpo_mega.rollout import EngineConfig, RolloutEngine, SamplingConfig
    from grpo_mega.testing.tiny import build_tiny_hf_checkpoint, build_tiny_tokenizer
    from grpo_mega.data.tokenizer import load_tokenizer

    root = Path(tempfile.mkdtemp(prefix="rollout_bench_"))
    tok_dir = build_tiny_tokenizer(root / "tok", "qwen2")
    shape = dict(hidden_size=args.hidden, num_layers=args.layers, num_heads=args.hidden // 32,
                 num_kv_heads=max(1, args.hidden // 64))
    model_a = build_tiny_hf_checkpoint(root / "a", "qwen2", tokenizer_dir=tok_dir, seed=0, **shape)
    model_b = build_tiny_hf_checkpoint(root / "b", "qwen2", tokenizer_dir=tok_dir, seed=1, **shape)
    params = sum(t.numel() for t in load_file(model_a / "model.safetensors").values())

    sampling = SamplingConfig(n=args.n, temperature=args.temperature, max_new_tokens=args.new_tokens,
                              ignore_eos=True, seed=0)
    start = time.perf_counter()
    eng = RolloutEngine(EngineConfig(str(model_a), mode=args.mode, max_model_len=256), sampling)
    startup = time.perf_counter() - start

    tok = load_tokenizer(tok_dir)
    prompts = [tok.encode(f"What is {i} + {2 * i}?") for i in range(args.prompts)]
    rates = []
    for step in range(3):
        batch = eng.generate(prompts, step=step)
        rates.append(batch.num_response_tokens / batch.seconds)

    weights = [load_file(m / "model.safetensors") for m in (model_b, model_a)]
    updates = [eng.update_weights(weights[i % 2]) for i in range(6)]

    idle_cpu = None
    if args.mode == "child":
        import psutil

        children = psutil.Process().children(recursive=True)
        before = sum(c.cpu_times().user + c.cpu_times().system for c in children)
        time.sleep(5.0)
        after = sum(c.cpu_times().user + c.cpu_times().system for c in children)
        idle_cpu = (after - before) / 5.0
    eng.shutdown()
    print(json.dumps({
        "mode": args.mode, "params": params, "prompts": args.prompts, "n": args.n,
        "new_tokens": args.new_tokens, "startup_s": round(startup, 1),
        "tokens_per_s": [round(r) for r in rates],
        "update_weights_ms_median": round(1000 * statistics.median(updates), 1),
        "idle_engine_cpu_fraction": None if idle_cpu is None else round(idle_cpu, 3),
        "load_avg_1m": os.getloadavg()[0],
    }))


if __name__ == "__main__":
    main()
