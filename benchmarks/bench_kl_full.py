"""Benchmark: the step cost of ``kl_kind: full`` (exact KL over the vocabulary) vs ``k3``.

What one "step" is for each kind (the work that differs between them; rollout, reward
and weight sync are the same for both and left out):
  k3    the reference log-prob pass (``compute_logprobs`` on the frozen reference, the
        loop's ``logprobs`` stage) + one update (``update_policy``, k3 on log-probs);
  full  one update with the reference run inside the schedule on every micro-batch and
        ``vocab_parallel_kl`` on the two logits shards (no separate reference pass).

Both run in one process on the same tiny megatron model and batch, interleaved
(k3, full, k3, full, ...) so that machine load hits both alike; the figure is the
median over ``--repeats`` after one warm-up each, and the ratio is full / k3. TP=1 on
CPU over gloo; wall and process CPU time are both reported.

Run (not a test; about a minute at the defaults):
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_kl_full.py
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_kl_full.py --vocab 32000 --repeats 5
"""
from __future__ import annotations

import argparse
import random
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--samples", type=int, default=16, help="sequences per step")
    ap.add_argument("--micro", type=int, default=4, help="sequences per micro-batch")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--response-len", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--dry-run", action="store_true", help="print the settings and exit")
    args = ap.parse_args()
    print(f"settings: {vars(args)}")
    if args.dry_run:
        return

    import torch

    from grpo_mega.config import AlgorithmConfig, ModelConfig, OptimizerConfig
    from grpo_mega.distributed.state import init_parallel
    from grpo_mega.models import build_model
    from grpo_mega.optim.adamw import ParallelAdamW
    from grpo_mega.trainer.batch import TrainingBatch
    from grpo_mega.trainer.passes import compute_logprobs, update_policy

    ps = init_parallel(1, 1, seed=0)
    cfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                      num_attention_heads=4, num_query_groups=2, ffn_hidden_size=4 * args.hidden,
                      make_vocab_size_divisible_by=128)
    model = build_model(cfg, ps)
    ref = build_model(cfg, ps, frozen=True)
    opt = ParallelAdamW(model, OptimizerConfig(lr=1e-7), ps)
    rng = random.Random(0)
    prompts = [[rng.randrange(4, args.vocab) for _ in range(args.prompt_len)] for _ in range(args.samples)]
    responses = [[rng.randrange(4, args.vocab) for _ in range(args.response_len - rng.randrange(8))]
                 for _ in range(args.samples)]
    adv = [rng.gauss(0, 1) for _ in range(args.samples)]
    kw = dict(vocab_size=args.vocab, temperature=1.0)

    def step(kind: str) -> None:
        b = TrainingBatch.pack(prompts, responses, [[-1.0] * len(r) for r in responses], adv,
                               pad_id=0, device=ps.device)
        algo = AlgorithmConfig(kl_coef=0.04, kl_kind=kind)
        if kind == "k3":
            b.ref_logp = b.empty_logp()
            compute_logprobs(ref, b.split(args.micro), ps, key="ref_logp", **kw)
        update_policy(model, opt, b.split(args.micro), ps, algo, max_len=args.response_len,
                      reuse_current_as_old=True, reference=ref if kind == "full" else None, **kw)

    times: dict[str, list[tuple[float, float]]] = {"k3": [], "full": []}
    for i in range(args.repeats + 1):
        for kind in ("k3", "full"):
            w0, c0 = time.perf_counter(), time.process_time()
            step(kind)
            if i:  # the first round is warm-up
                times[kind].append((time.perf_counter() - w0, time.process_time() - c0))
    tokens = sum(map(len, prompts)) + sum(map(len, responses))
    print(f"{tokens} tokens per step, vocab {args.vocab}, {args.samples // args.micro} micro-batches, "
          f"median of {args.repeats}")
    med = {k: (statistics.median(t[0] for t in v), statistics.median(t[1] for t in v))
           for k, v in times.items()}
    print(f"{'kind':<6}{'wall s':>10}{'CPU s':>10}")
    for k, (w, c) in med.items():
        print(f"{k:<6}{w:>10.3f}{c:>10.3f}")
    print(f"full / k3: wall {med['full'][0] / med['k3'][0]:.2f}x, CPU {med['full'][1] / med['k3'][1]:.2f}x")


if __name__ == "__main__":
    main()
