"""Benchmark: full fine-tuning vs LoRA at one shape, side by side: memory, update time, sync bytes.

Each mode runs in its own child process (so its peak RSS is its own), one after the other:
  full   the model trains every parameter (``ParallelAdamW`` over all of them); the KL
         reference is a second, frozen model (``build_model(..., frozen=True)``), as the trainer
         builds it when ``model.lora`` is null
  lora   the same model with ``grpo_mega.lora.attach_lora`` (rank --rank on qkv, proj, fc1, fc2):
         the base frozen, the optimizer over the adapters only, the reference
         ``lora.ReferenceView`` (the actor with adapters off), as ``trainer.build_trainer`` does
One step = the reference log-prob pass (``compute_logprobs``) + the update (``update_policy``:
forward, backward, AdamW step) on the same fixed batch (--samples rows of --prompt + --response
tokens). Per mode: the state a step holds (weights, the reference's, fp32 gradients of the
trainable parameters from the backward to the step, Adam moments: bytes, exact), the process's peak RSS (``ru_maxrss``, everything:
Python, torch, megatron imports, activations), the median update and reference CPU seconds
of --repeats steps after a warm-up (this one-thread process: steadier than wall time on a
shared machine), and the bytes a weight sync ships: every weight (full, and LoRA ``merged``:
W + scale B A in the same names) or the adapters alone (LoRA ``adapter``: the trainer's adapter
tensors; PEFT's layout, which vLLM loads, repeats the shared A of q, k, v and of gate, up). The
sync's seconds into a real engine, and PEFT's bytes, are ``bench_lora_sync.py``'s (it starts vLLM
twice per size).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_lora_memory.py --shape 100m \
        --samples 4 --prompt 32 --response 96 --repeats 2                           # 126M, ~2 min
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_lora_memory.py --smoke        # seconds, in-process

Not a test: numbers depend on the machine and its load. TP=1, CPU, float32. Reward after the
same number of steps is not compared here (no task runs in a few CPU minutes at 100M).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_packing import SHAPES  # noqa: E402  (the 100M shape, built in-process)

MODES = ("full", "lora")


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def run_mode(mode: str, shape: str, rank: int, samples: int, prompt: int, response: int, repeats: int) -> dict:
    """Build ``mode``'s model, reference and optimizer; time ``repeats`` steps; return figures."""
    import torch

    from grpo_mega import lora as L
    from grpo_mega.config import AlgorithmConfig, LoraConfig, ModelConfig, OptimizerConfig
    from grpo_mega.distributed.state import init_parallel
    from grpo_mega.models import build_model
    from grpo_mega.optim.adamw import ParallelAdamW
    from grpo_mega.trainer.batch import TrainingBatch
    from grpo_mega.trainer.microbatches import cut, plan_micro_batches
    from grpo_mega.trainer.passes import compute_logprobs, update_policy

    ps = init_parallel(1, 1, seed=0)
    cfg = ModelConfig(**SHAPES[shape], make_vocab_size_divisible_by=128)
    torch.manual_seed(0)
    model = build_model(cfg, ps)
    if mode == "lora":
        L.attach_lora(model, LoraConfig(rank=rank, alpha=2.0 * rank), ps, seed=0)
        ref = L.ReferenceView(model)
    else:
        ref = build_model(cfg, ps, frozen=True)
    opt = ParallelAdamW(model, OptimizerConfig(lr=1e-5), ps)
    algo = AlgorithmConfig(kl_coef=0.005, kl_kind="k3")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, cfg.vocab_size) for _ in range(prompt)] for _ in range(samples)]
    responses = [[rng.randrange(3, cfg.vocab_size) for _ in range(response)] for _ in range(samples)]
    adv = [rng.gauss(0, 1) for _ in range(samples)]
    kw = dict(vocab_size=cfg.vocab_size, temperature=1.0)
    steps = []
    for _ in range(repeats + 1):
        b = TrainingBatch.pack(prompts, responses, [[-1.0] * response] * samples, adv, pad_id=0,
                               device=ps.device, packing=True)
        b, sizes, _ = plan_micro_batches(b, len(b), samples, max_tokens=0, device=ps.device)
        b.ref_logp = b.empty_logp()
        micro = cut(b, sizes)[0]
        c0 = time.process_time()
        compute_logprobs(ref, micro, ps, key="ref_logp", **kw)
        c1 = time.process_time()
        update_policy(model, opt, micro, ps, algo, max_len=response, reuse_current_as_old=True, **kw)
        steps.append((c1 - c0, time.process_time() - c1))
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    ref_params = [] if mode == "lora" else list(ref.parameters())
    adapter_bytes = _bytes(trainable) if mode == "lora" else 0
    return {"mode": mode, "params": sum(p.numel() for p in params), "trainable": sum(p.numel() for p in trainable),
            "weights_bytes": _bytes(params), "reference_bytes": _bytes(ref_params),
            # fp32 grads of the trainable parameters, held from the backward to the step
            # (ParallelAdamW frees them after it)
            "grad_bytes": sum(p.numel() * 4 for p in trainable), "optimizer_bytes": opt.state_bytes(),
            "ref_s": statistics.median(s[0] for s in steps[1:]), "update_s": statistics.median(s[1] for s in steps[1:]),
            "sync_bytes": _bytes(p for n, p in model.named_parameters() if not L.is_lora_name(n)),
            "adapter_sync_bytes": adapter_bytes,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _report(rows: dict, args, load: float) -> None:
    mib = 2 ** 20
    print(f"model {args.shape}, {rows['full']['params'] / 1e6:.1f}M params, float32, TP 1, CPU; "
          f"LoRA rank {args.rank} on qkv/proj/fc1/fc2 ({rows['lora']['trainable'] / 1e6:.2f}M trainable); "
          f"batch {args.samples} rows x ({args.prompt} + {args.response}) tokens, one micro-batch, packed; "
          f"median of {args.repeats} steps after a warm-up (CPU s, one thread); load average {load:.1f}")
    print(f"{'mode':<6}{'trainable M':>12}{'weights MiB':>12}{'ref MiB':>9}{'grads MiB':>10}{'optim MiB':>10}"
          f"{'state MiB':>10}{'peak RSS MiB':>13}{'ref s':>8}{'update s':>9}{'sync MB':>9}")
    for m in MODES:
        r = rows[m]
        r["state_bytes"] = r["weights_bytes"] + r["reference_bytes"] + r["grad_bytes"] + r["optimizer_bytes"]
        sync = r["adapter_sync_bytes"] or r["sync_bytes"]
        print(f"{m:<6}{r['trainable'] / 1e6:>12.2f}{r['weights_bytes'] / mib:>12.1f}{r['reference_bytes'] / mib:>9.1f}"
              f"{r['grad_bytes'] / mib:>10.1f}{r['optimizer_bytes'] / mib:>10.1f}{r['state_bytes'] / mib:>10.1f}"
              f"{r['peak_rss_mib']:>13.0f}{r['ref_s']:>8.3f}{r['update_s']:>9.3f}{sync / 1e6:>9.2f}")
    f, lo = rows["full"], rows["lora"]
    print(f"lora / full: state {lo['state_bytes'] / f['state_bytes']:.3f}x, peak RSS "
          f"{lo['peak_rss_mib'] / f['peak_rss_mib']:.3f}x, update {lo['update_s'] / f['update_s']:.2f}x, "
          f"reference pass {lo['ref_s'] / f['ref_s']:.2f}x; sync: full {f['sync_bytes'] / 1e6:.2f} MB, "
          f"merged {lo['sync_bytes'] / 1e6:.2f} MB, adapter {lo['adapter_sync_bytes'] / 1e6:.2f} MB")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="100m")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--response", type=int, default=192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny shape, one repeat, both modes in this process")
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.smoke:
        args.shape, args.rank, args.samples, args.prompt, args.response, args.repeats = "smoke", 4, 2, 8, 8, 1
    run = dict(shape=args.shape, rank=args.rank, samples=args.samples, prompt=args.prompt,
               response=args.response, repeats=args.repeats)
    if args.child:
        print("RESULT " + json.dumps(run_mode(args.child, **run)), flush=True)
        return {}
    rows = {}
    for m in MODES:
        if args.smoke:  # in-process: the RSS column is then the process's, not the mode's
            from grpo_mega.distributed.state import destroy_parallel
            try:
                rows[m] = run_mode(m, **run)
            finally:
                destroy_parallel()
            continue
        out = subprocess.run([sys.executable, __file__, "--child", m] + list(argv if argv is not None else sys.argv[1:]),
                             check=True, capture_output=True, text=True).stdout
        rows[m] = json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[7:])
    _report(rows, args, os.getloadavg()[0])
    return rows


if __name__ == "__main__":
    main()
