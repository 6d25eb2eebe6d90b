"""Benchmark: peak memory of the update's loss on one TP rank's logits shard, three ways.

What it measures
    The loss-side work of one update micro-batch on a TP rank: from the model's logits
    shard ``[b, s, V_pad/tp]`` to log pi(y) (with gradient), the entropy metric (no
    gradient) and ``backward()`` into the shard, at the sampling temperature with
    megatron's padded vocabulary masked. Per variant, in a FRESH child process (one at a
    time, so each high-water mark belongs to one variant alone): peak extra memory =
    VmHWM after the work minus the RSS just before it (logits and targets already
    allocated, the high-water mark reset after the set-up; the shard's gradient, which
    every variant makes, is counted), and the
    wall time of one forward + backward after a warm-up.

    One rank of TP=2 is emulated in one process: the rank holds V_pad/2 columns, and the
    naive variant's all-gather is a concatenation with the other rank's shard (same
    buffers as ``all_gather``). The per-rank collectives of the vocab-parallel functions
    are all-reduces over [tokens] and change no memory figure; running both ranks at
    once would need twice the RAM of the naive variant, which this machine lacks.

Variants
    naive   the full vocabulary on every rank: gather, mask, upcast, / T, log_softmax,
            pick the target; entropy from the same [tokens, V] tensors.
    copy    the loop before ``algorithm.logits_chunk_size``: a masked, fp32, / T copy of
            the shard (``mask_vocab_padding(logits[:, :-1]).float() / T``), then the
            vocab-parallel functions over it in one block.
    lean    the loop now: ``micro_loss``'s calls, the raw shard and
            ``temperature``/``vocab_size``/``chunk_size`` passed to the functions.

Run (about 25 GB-minutes of RAM at the default size; a few minutes on 2 cores):
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_update_memory.py \\
        --tokens 8192 --vocab 128200 --tp 2 --chunk-size 1024 --dtype bfloat16
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time

VARIANTS = ("naive", "copy", "lean")


def _high_water_mark() -> int:
    """Peak RSS in bytes since the last reset (VmHWM; ``clear_refs`` 5 resets it, Linux >= 4.0)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def _work(variant: str, args, queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import psutil
    import torch

    from grpo_mega import algorithms as A
    from grpo_mega.models import mask_vocab_padding

    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    b = args.seqs
    s = args.tokens // b + 1  # one more position than targets, as a causal LM's logits
    v_pad = -(-args.vocab // (128 * args.tp)) * 128 * args.tp
    width, rank, temp = v_pad // args.tp, args.rank, args.temperature
    gen = torch.Generator().manual_seed(0)
    shard = (torch.randn(b, s, width, generator=gen) * 2).to(dtype).requires_grad_()
    other = (torch.randn(b, s, width, generator=gen) * 2).to(dtype) if variant == "naive" else None
    targets = torch.randint(0, args.vocab, (b, s - 1), generator=gen)
    local_targets = targets % min(max(args.vocab - rank * width, 1), width)  # ids this "rank" holds
    weights = torch.rand(b, s - 1, generator=gen)

    def naive():
        parts = [other, shard] if rank else [shard, other]
        full = mask_vocab_padding(torch.cat(parts, dim=-1)[:, :-1], args.vocab, 0).float() / temp
        lsm = torch.log_softmax(full, dim=-1)
        logp = lsm.gather(-1, targets[..., None]).squeeze(-1)
        with torch.no_grad():
            ent = -(lsm.exp() * lsm).sum(-1)
        return logp, ent

    def copy():
        z = mask_vocab_padding(shard[:, :-1], args.vocab, rank).float() / temp
        logp = A.vocab_parallel_logprobs(z, local_targets)
        with torch.no_grad():
            ent = A.vocab_parallel_entropy(z.detach())
        return logp, ent

    def lean():
        # One process stands for the rank (no group): its real columns are the vocab.
        kw = dict(temperature=temp, vocab_size=min(max(args.vocab - rank * width, 1), width),
                  chunk_size=args.chunk_size)
        tgt = torch.nn.functional.pad(local_targets, (0, 1))
        logp = A.vocab_parallel_logprobs(shard, tgt, **kw)[:, :-1]
        with torch.no_grad():
            ent = A.vocab_parallel_entropy(shard.detach(), **kw)[:, :-1]
        return logp, ent

    fn = dict(naive=naive, copy=copy, lean=lean)[variant]
    times = []
    # Forget the set-up's own peak (the fp32 randn behind a bf16 shard is 2 shards), so the
    # high-water mark read below is the work's alone.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    rss_before = psutil.Process().memory_info().rss
    for _ in range(2):  # a warm-up, then the timed pass; both reach the same peak
        shard.grad = None
        t0 = time.perf_counter()
        logp, ent = fn()
        (logp * weights).sum().backward()
        times.append(time.perf_counter() - t0)
        del logp, ent
    peak = _high_water_mark()
    queue.put(dict(variant=variant, extra=peak - rss_before, time=times[-1],
                   shard=shard.numel() * shard.element_size()))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192, help="target tokens in the micro-batch")
    ap.add_argument("--seqs", type=int, default=8, help="sequences the tokens are split into")
    ap.add_argument("--vocab", type=int, default=128200,
                    help="real vocabulary, padded to a multiple of 128 x tp (128256 at tp=2)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--rank", type=int, default=1, help="the emulated TP rank (the last holds the padding)")
    ap.add_argument("--chunk-size", type=int, default=1024)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    rows = {}
    for v in args.variants.split(","):
        queue = ctx.SimpleQueue()
        p = ctx.Process(target=_work, args=(v, args, queue))
        p.start()
        p.join()
        if p.exitcode:
            raise SystemExit(f"{v}: the child failed (exit code {p.exitcode})")
        rows[v] = queue.get()
    gib = 2 ** 30
    shard = next(iter(rows.values()))["shard"]
    print(f"update loss on one TP rank: {args.tokens} tokens x {args.vocab} vocab, tp={args.tp} "
          f"(shard {shard / gib:.2f} GiB {args.dtype}), T={args.temperature}, chunk={args.chunk_size}")
    base = rows.get("naive", {}).get("extra")
    for v, r in rows.items():
        ratio = f"{r['extra'] / base:5.2f}x naive" if base else ""
        print(f"  {v:6s} peak extra {r['extra'] / gib:6.2f} GiB ({r['extra'] / shard:5.2f} shards) "
              f"{ratio}  fwd+bwd {r['time']:6.2f} s")


if __name__ == "__main__":
    main()
