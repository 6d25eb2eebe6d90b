"""Benchmark: full fine-tuning vs LoRA at one shape, side by side: memory, step time, sync bytes, learning.

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

Then the learning comparison (``lora_learning.py``, --learn-steps; 0 skips it). First a
child of its own builds the base (seed 0) and trains it for --warm-steps of next-token
cross-entropy on a synthetic language of two token classes (``lora_learning.warm_start``;
0: the random model), and saves it; each mode's child then loads that one file, attaches
LoRA or builds the frozen reference copy, and runs --learn-steps GRPO steps of the trainer's
math (``lora_learning.learn_task``): prompts of the language, half of each class, --group
responses each sampled from the policy itself (plain torch, temperature 1), reward = the
share of response tokens in class A (``--target class``; ``direction`` is the random-start
task of the first figures), advantages ``algorithms.group_advantages``, k3 KL at kl_coef
0.005 against the mode's reference, ``compute_logprobs`` + ``update_policy``; full and LoRA
each at their own learning rate (--lr-full, --lr-lora). Held out before and after: mean
reward (and on the B prompts alone) and accuracy (share of samples with reward >=
--threshold) of --eval-samples sampled responses to each of --eval-prompts prompts, the same
sampling seed each time. The defaults are those of the figures in
docs/evidence/benchmarks-2026-11.md (lrs picked by a small sweep there); the peak RSS above
is taken before this part.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_lora_memory.py --shape 100m \
        --samples 4 --prompt 32 --response 96 --repeats 2 --jobs 2   # 126M, 7 min (--learn-steps 0: timing only)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_lora_memory.py --shape 100m ... \
        --warm-steps 0 --target direction --lr-full 3e-3 --lr-lora 3e-2     # the random-start figures
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_lora_memory.py --smoke        # seconds, in-process

Not a test: numbers depend on the machine and its load. TP=1, CPU, float32.
"""
from __future__ import annotations

import argparse
import gc
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
from lora_learning import learn_task, report_base, report_learning, warm_start  # noqa: E402

MODES = ("full", "lora")


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def run_mode(mode: str, shape: str, rank: int, samples: int, prompt: int, response: int, repeats: int,
             learn: dict | None = None) -> dict:
    """Build ``mode``'s model, reference and optimizer; time ``repeats`` steps; return figures.
    ``learn``: then free them and run the learning comparison (``learn_task``) with these
    keyword arguments; its figures go under ``"learn"``."""
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
    out = {"mode": mode, "params": sum(p.numel() for p in params), "trainable": sum(p.numel() for p in trainable),
            "weights_bytes": _bytes(params), "reference_bytes": _bytes(ref_params),
            # fp32 grads of the trainable parameters, held from the backward to the step
            # (ParallelAdamW frees them after it)
            "grad_bytes": sum(p.numel() * 4 for p in trainable), "optimizer_bytes": opt.state_bytes(),
            "ref_s": statistics.median(s[0] for s in steps[1:]), "update_s": statistics.median(s[1] for s in steps[1:]),
            "sync_bytes": _bytes(p for n, p in model.named_parameters() if not L.is_lora_name(n)),
            "adapter_sync_bytes": adapter_bytes,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if learn:
        # The timing's model (moved by its steps) is dropped: the learning starts from the
        # saved base in both modes. Its smaller batches do not raise the peak above.
        del model, ref, opt, params, trainable, ref_params, micro, b
        gc.collect()
        out["learn"] = learn_task(mode, cfg, ps, rank, **learn)
    return out


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
    if "base" in rows:
        report_base(rows["base"])
    if "learn" in f:
        report_learning(rows, args, MODES)


def make_base(shape: str, path: str, **warm) -> dict:
    """Build the base (seed 0), train it (``lora_learning.warm_start`` with ``warm``), save its
    state dict to ``path`` (our own file, read back with ``weights_only``); its figures."""
    import torch

    from grpo_mega.config import ModelConfig
    from grpo_mega.distributed.state import init_parallel

    ps = init_parallel(1, 1, seed=0)
    state, fig = warm_start(ModelConfig(**SHAPES[shape], make_vocab_size_divisible_by=128), ps, **warm)
    torch.save(state, path)
    return fig


def _child(argv: list[str], name: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, "--child", name] + argv, stdout=subprocess.PIPE, text=True)


def _result(name: str, proc: subprocess.Popen) -> dict:
    out = proc.communicate()[0]
    if proc.returncode:
        raise RuntimeError(f"the {name} child exited with {proc.returncode}")
    return json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[7:])


def _children(argv: list[str], jobs: int, learn: bool) -> dict:
    """The base's figures from a child of its own (first, when ``learn``), then each mode's
    from its own child process, ``jobs`` at a time (its peak RSS and CPU seconds are its own
    either way; 2 halves the wall time on a loaded machine)."""
    import tempfile

    rows, pending = {}, list(MODES)
    with tempfile.TemporaryDirectory(prefix="lora_bench_") as tmp:
        argv = argv + ["--base-file", str(Path(tmp) / "base.pt")]
        if learn:
            rows["base"] = _result("base", _child(argv, "base"))
        while pending:
            batch, pending = pending[:jobs], pending[jobs:]
            procs = {m: _child(argv, m) for m in batch}
            rows.update({m: _result(m, proc) for m, proc in procs.items()})
    return rows


def _warm_kw(args) -> dict:
    return dict(steps=args.warm_steps, lr=args.warm_lr, batch=args.warm_batch,
                length=args.learn_prompt + args.learn_response, noise=args.warm_noise)


def _learn_kw(args, mode: str) -> dict | None:
    if args.learn_steps <= 0:
        return None
    return dict(base=args.base_file, steps=args.learn_steps, lr=args.lr_lora if mode == "lora" else args.lr_full,
                prompts=args.learn_prompts, group=args.group, prompt_len=args.learn_prompt,
                response_len=args.learn_response, eval_prompts=args.eval_prompts,
                eval_samples=args.eval_samples, threshold=args.threshold, target=args.target,
                target_frac=args.target_frac, noise=args.warm_noise)


def _in_process(args, run: dict) -> dict:
    """``_children``'s figures with the base and both modes run in this process, one by one."""
    import tempfile

    from grpo_mega.distributed.state import destroy_parallel

    rows = {}
    with tempfile.TemporaryDirectory(prefix="lora_bench_") as tmp:
        args.base_file = str(Path(tmp) / "base.pt")
        for name in (("base",) if args.learn_steps > 0 else ()) + MODES:
            try:
                rows[name] = (make_base(args.shape, args.base_file, **_warm_kw(args)) if name == "base"
                              else run_mode(name, **run, learn=_learn_kw(args, name)))
            finally:
                destroy_parallel()
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="100m")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--response", type=int, default=192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--learn-steps", type=int, default=12, help="GRPO steps of the learning comparison (0: none)")
    ap.add_argument("--learn-prompts", type=int, default=8, help="prompts per learning step")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt (GRPO group)")
    ap.add_argument("--learn-prompt", type=int, default=8, help="prompt tokens in the learning task")
    ap.add_argument("--learn-response", type=int, default=4, help="response tokens in the learning task")
    ap.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts")
    ap.add_argument("--eval-samples", type=int, default=4, help="sampled responses per held-out prompt")
    ap.add_argument("--warm-steps", type=int, default=50,
                    help="next-token training steps of the base before RL (0: the random model)")
    ap.add_argument("--warm-lr", type=float, default=1e-3, help="the base's AdamW learning rate")
    ap.add_argument("--warm-batch", type=int, default=16, help="sequences per warm-start step")
    ap.add_argument("--warm-noise", type=float, default=0.1,
                    help="the class language's chance of a token from the other class")
    ap.add_argument("--target", choices=("class", "direction", "block"), default="class",
                    help="the rewarded tokens: class A of the base's language (needs --warm-steps > 0), "
                         "or, for a random model, those whose output row projects most on a fixed "
                         "direction, or the last ids (a block)")
    ap.add_argument("--target-frac", type=float, default=0.5,
                    help="the rewarded share of the vocabulary (--target direction, block)")
    ap.add_argument("--threshold", type=float, default=0.75, help="accuracy: share of samples with reward >= this")
    ap.add_argument("--lr-full", type=float, default=3e-4, help="learning rate of full fine-tuning")
    ap.add_argument("--lr-lora", type=float, default=3e-3, help="learning rate of LoRA")
    ap.add_argument("--jobs", type=int, default=1, choices=(1, 2), help="mode children run at once")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--smoke", action="store_true", help="tiny shape, one repeat, both modes in this process")
    ap.add_argument("--child", choices=MODES + ("base",), help=argparse.SUPPRESS)
    ap.add_argument("--base-file", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.target == "class" and args.warm_steps <= 0 and args.learn_steps > 0:
        ap.error("--target class rewards a class the base learns in its warm start: with --warm-steps 0 "
                 "(a random model) use --target direction")
    if args.smoke:
        args.shape, args.rank, args.samples, args.prompt, args.response, args.repeats = "smoke", 4, 2, 8, 8, 1
        args.learn_steps, args.learn_prompts, args.group, args.learn_prompt = min(args.learn_steps, 1), 2, 4, 4
        args.learn_response, args.eval_prompts, args.eval_samples = 4, 2, 2
        args.warm_steps, args.warm_batch = min(args.warm_steps, 4), 4
    run = dict(shape=args.shape, rank=args.rank, samples=args.samples, prompt=args.prompt,
               response=args.response, repeats=args.repeats)
    if args.child == "base":
        print("RESULT " + json.dumps(make_base(args.shape, args.base_file, **_warm_kw(args))), flush=True)
        return {}
    if args.child:
        print("RESULT " + json.dumps(run_mode(args.child, **run, learn=_learn_kw(args, args.child))), flush=True)
        return {}
    if args.smoke:  # in-process: the RSS column is then the process's, not the mode's
        rows = _in_process(args, run)
    else:
        rows = _children(list(argv if argv is not None else sys.argv[1:]), args.jobs, args.learn_steps > 0)
    _report(rows, args, os.getloadavg()[0])
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
