"""Benchmark: wall time of one tool-sandbox call (``grpo_mega.envs.Sandbox.run``).

Why it matters: every ``python`` tool call of every episode pays it, on the replica's
first rank, inside the step's budget (``env.turn_budget_seconds``).

What is run: ``Sandbox().run("print(6*7)")`` --calls times after one warm-up, one after
the other; each call builds the whole sandbox (fresh process, namespaces, tmpfs scratch,
Landlock, seccomp, rlimits) and tears it down. Reported: median and 90th percentile in
ms, and the load average while it ran.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_sandbox.py --calls 50
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from grpo_mega.envs import Sandbox


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args()
    sandbox = Sandbox()
    sandbox.check()
    times = []
    for _ in range(args.calls):
        t0 = time.perf_counter()
        r = sandbox.run("print(6*7)")
        times.append((time.perf_counter() - t0) * 1e3)
        assert r.stdout == "42\n", r
    times.sort()
    print(f"sandbox call: median {statistics.median(times):.1f} ms, p90 {times[int(0.9 * len(times))]:.1f} ms "
          f"over {args.calls} calls; load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
