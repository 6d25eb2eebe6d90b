"""Benchmark: vocab-parallel log-probs vs the naive all-gather + log_softmax, at TP on CPU.

What it measures, per method, in a FRESH set of gloo ranks (so each process's
RSS high-water mark belongs to that method alone):
  * time of one forward + backward of sum(log p(target)) w.r.t. the logits
    shard (median of --reps, after one warm-up), as wall time and as the
    rank's CPU time; on a shared, oversubscribed machine the CPU time is the
    steadier figure;
  * peak extra memory per rank: ru_maxrss after the runs minus the RSS just
    before them (inputs already allocated), max over ranks. tracemalloc does
    not see torch's allocations; RSS does, because glibc serves these large
    buffers with mmap and returns them on free.

Methods:
  naive    all_gather the [T, V/tp] shards into [T, V], log_softmax, pick the
           target; each rank differentiates its own copy of the full loss, so
           the gradient w.r.t. its shard is exact without a reduce-scatter.
  ours     grpo_mega.algorithms.vocab_parallel_logprobs, chunk_size=None.
  chunked  the same with --chunk-size tokens per chunk.

Run (not a test; a few minutes and about 8 GB of RAM at the default size, mostly the naive run):
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_vocab_parallel.py \
        --tokens 8192 --vocab 32000 --tp 2 --chunk-size 1024
"""
from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import time
from datetime import timedelta

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _naive_logprobs(shard, targets, group):
    import torch
    import torch.distributed as dist
    parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, shard.detach(), group=group)
    parts[dist.get_rank(group)] = shard  # keep the local slice in the graph
    full = torch.cat(parts, dim=-1)
    return torch.log_softmax(full, dim=-1).gather(-1, targets[:, None]).squeeze(-1)


def _worker(rank, world, port, method, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import psutil
    import torch
    import torch.distributed as dist

    from grpo_mega.algorithms import vocab_parallel_logprobs

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    group = dist.group.WORLD
    vs = args.vocab // world
    gen = torch.Generator().manual_seed(1234 + rank)
    shard = (torch.randn(args.tokens, vs, generator=gen) * 2).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=torch.Generator().manual_seed(7))

    def step():
        if shard.grad is not None:
            shard.grad = None
        if method == "naive":
            logp = _naive_logprobs(shard, targets, group)
        else:
            chunk = args.chunk_size if method == "chunked" else None
            logp = vocab_parallel_logprobs(shard, targets, group, chunk_size=chunk)
        logp.sum().backward()
        return logp.detach()

    dist.barrier()
    rss_before = psutil.Process().memory_info().rss
    times, cpu = [], []
    for i in range(args.reps + 1):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        logp = step()
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        if i:  # the first run is a warm-up
            times.append(dt)
            cpu.append(dc)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    queue.put(dict(rank=rank, time=statistics.median(times), cpu=statistics.median(cpu),
                   extra=peak - rss_before,
                   logp_sum=float(logp.double().sum()), grad_abs=float(shard.grad.double().abs().sum())))
    dist.destroy_process_group()


def run(method, args):
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, args.tp, port, method, args, queue))
             for r in range(args.tp)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise SystemExit(f"{method}: a rank failed (exit codes {[p.exitcode for p in procs]})")
    res = [queue.get() for _ in procs]
    return dict(time=max(r["time"] for r in res), cpu=max(r["cpu"] for r in res),
                extra=max(r["extra"] for r in res),
                logp_sum=sum(r["logp_sum"] for r in res) / len(res),
                grad_abs=sum(r["grad_abs"] for r in res))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--chunk-size", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--methods", default="naive,ours,chunked")
    args = ap.parse_args()
    if args.vocab % args.tp:
        raise SystemExit(f"--vocab {args.vocab} must be divisible by --tp {args.tp}")

    shard_mib = args.tokens * args.vocab // args.tp * 4 / 2**20
    print(f"T={args.tokens} V={args.vocab} TP={args.tp} fp32, shard [T, V/tp] = {shard_mib:.0f} MiB/rank, "
          f"chunk={args.chunk_size}, median of {args.reps} fwd+bwd after 1 warm-up")
    results = {m: run(m, args) for m in args.methods.split(",")}
    base = results.get("naive")
    print(f"{'method':8} {'wall s':>7} {'cpu s':>7} {'peak extra MiB/rank':>20} {'x shard':>8} "
          f"{'wall/naive':>10} {'cpu/naive':>10} {'mem/naive':>10}  "
          f"checksums (mean logp sum, sum |grad|)")
    for m, r in results.items():
        rel = {k: f"{r[k] / base[k]:.2f}" if base else "-" for k in ("time", "cpu", "extra")}
        print(f"{m:8} {r['time']:7.2f} {r['cpu']:7.2f} {r['extra'] / 2**20:20.0f} "
              f"{r['extra'] / 2**20 / shard_mib:8.2f} {rel['time']:>10} {rel['cpu']:>10} "
              f"{rel['extra']:>10}  {r['logp_sum']:.6e} {r['grad_abs']:.6e}")


if __name__ == "__main__":
    main()
