"""Benchmark: peak memory and time of one update on a long episode with few trainable tokens,
the output layer at every position (the path before) against only the trainable ones.

What it measures
    One GRPO update (``update_policy``: forward, loss, backward, AdamW step) of a tiny
    megatron GPTModel (TP=1, bf16, one layer, hidden 64) on one episode of ``--tokens``
    tokens of which ``--trainable`` are the model's, in ``--turns`` turns spread over the
    episode (tool output between them, the last turn at the end), at a vocabulary of
    ``--vocab``. Per variant and length, in a FRESH child process (one at a time, so each
    high-water mark is one variant's alone): peak extra memory = VmHWM after the work minus
    the RSS just before it (model, batch and optimizer built; the mark reset after the
    set-up), and the wall time of the second of two updates (the first warms up).

Variants
    all        ``all_positions=True``: logits ``[tokens, V]`` and their gradient.
    trainable  the default: logits ``[K, V]`` at the K trainable positions only.
    floor      the same update with nothing trainable (K = 0): the decoder alone, so
               ``peak - floor`` is what the logits cost (the attention scores of a 16k
               episode are the same in every variant and would hide it otherwise).

Run (the ``all`` variant at 16k tokens x 128k vocab needs about 10 GB of RAM; a few minutes):
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/trainable_logits.py
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/trainable_logits.py --lengths 2048 --vocab 32000 --trainable 256
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time

VARIANTS = ("all", "trainable", "floor")


def _high_water_mark() -> int:
    """Peak RSS in bytes since the last reset (VmHWM; ``clear_refs`` 5 resets it, Linux >= 4.0)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def episode_mask(tokens: int, trainable: int, turns: int):
    """[1, tokens-1] bool: ``turns`` runs of model tokens, evenly spaced, the last one ending
    the episode; everything before and between them is prompt or tool output."""
    import torch

    mask = torch.zeros(1, tokens - 1, dtype=torch.bool)
    per, gap = trainable // turns, (tokens - 1) // turns
    for k in range(turns):
        end = (k + 1) * gap if k < turns - 1 else tokens - 1
        n = per if k < turns - 1 else trainable - per * (turns - 1)
        mask[0, end - n:end] = True
    return mask


def _work(variant: str, tokens: int, args, queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import psutil
    import torch

    from grpo_mega.config import AlgorithmConfig, ModelConfig, OptimizerConfig
    from grpo_mega.distributed.state import init_parallel
    from grpo_mega.models import build_model
    from grpo_mega.optim.adamw import ParallelAdamW
    from grpo_mega.trainer.batch import TrainingBatch, update_policy

    ps = init_parallel(1, 1, seed=0)
    cfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=1, num_attention_heads=2,
                      num_query_groups=1, ffn_hidden_size=2 * args.hidden, dtype=args.dtype,
                      max_position_embeddings=tokens)
    model = build_model(cfg, ps)
    opt = ParallelAdamW(model, OptimizerConfig(lr=1e-7), ps)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (1, tokens), generator=g)
    mask = episode_mask(tokens, 0 if variant == "floor" else args.trainable, args.turns)
    batch = TrainingBatch(tokens=ids, targets=ids[:, 1:], loss_mask=mask, advantages=torch.ones(1),
                          rollout_logp=torch.zeros(1, tokens - 1), seq_lens=[tokens])
    algo = AlgorithmConfig(kl_coef=0.0)
    kw = dict(vocab_size=args.vocab, temperature=args.temperature, max_len=args.trainable,
              reuse_current_as_old=True, chunk_size=args.chunk_size, all_positions=variant == "all")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    rss_before = psutil.Process().memory_info().rss
    times = []
    for _ in range(2):  # a warm-up (Adam's state is made there), then the timed update
        t0 = time.perf_counter()
        update_policy(model, opt, [batch], ps, algo, **kw)
        times.append(time.perf_counter() - t0)
    peak = _high_water_mark()
    queue.put(dict(extra=peak - rss_before, time=times[-1], k=int(mask.sum())))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="4096,16384", help="episode lengths in tokens, comma-separated")
    ap.add_argument("--trainable", type=int, default=1024, help="the model's tokens in an episode")
    ap.add_argument("--turns", type=int, default=8, help="model turns the trainable tokens come in")
    ap.add_argument("--vocab", type=int, default=128256, help="real vocabulary (padded to a multiple of 1024)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--chunk-size", type=int, default=1024, help="algorithm.logits_chunk_size")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--dry-run", action="store_true", help="print the settings and exit")
    args = ap.parse_args()
    print(f"settings: {vars(args)}")
    if args.dry_run:
        return
    ctx = mp.get_context("spawn")
    rows = {}
    for tokens in (int(x) for x in args.lengths.split(",")):
        for v in args.variants.split(","):
            queue = ctx.SimpleQueue()
            p = ctx.Process(target=_work, args=(v, tokens, args, queue))
            p.start()
            p.join()
            if p.exitcode:
                raise SystemExit(f"{v} at {tokens} tokens: the child failed (exit code {p.exitcode})")
            rows[tokens, v] = queue.get()
    gib = 2 ** 30
    print(f"one update, TP=1, {args.dtype}, vocab {args.vocab}, hidden {args.hidden}, "
          f"{args.trainable} trainable tokens in {args.turns} turns, chunk {args.chunk_size}")
    print(f"| tokens | variant | rows at the output layer | peak extra GiB | minus floor GiB | update s |"
          f" vs all (memory, time) |")
    print("|---:|---|---:|---:|---:|---:|---|")
    for (tokens, v), r in rows.items():
        floor = rows.get((tokens, "floor"), {}).get("extra")
        base = rows.get((tokens, "all"))
        over = "" if floor is None else f"{(r['extra'] - floor) / gib:.2f}"
        ratio = (f"{r['extra'] / base['extra']:.2f}x, {r['time'] / base['time']:.2f}x"
                 if base and v != "all" else "")
        n = tokens if v == "all" else r["k"]
        print(f"| {tokens} | {v} | {n} | {r['extra'] / gib:.2f} | {over} | {r['time']:.2f} | {ratio} |")


if __name__ == "__main__":
    main()
