"""Benchmark: CPU seconds of a short training process, with and without freezing the garbage
collector's view of the process before vLLM starts (``RolloutEngine._build_llm``).

Why it matters: the suite and every restart pay a process's start-up many times over (a
two-step run is mostly imports and the engine's start), and vLLM runs several full garbage
collections while it starts, each walking every object the imports and models made.

What is run: the embedded demo's two-step job at TP=1 (one process, vLLM in it, packaged
demo model), --repeats times each way, alternating. "unfrozen" is the same command with
the engine module's ``gc.freeze`` replaced by a no-op (vLLM's own freeze at the end of its
start is left as it is). Reported: the median CPU seconds (user + system, the process and
its reward workers) and wall seconds of each, and their ratio (frozen / unfrozen).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_startup.py --repeats 3
"""
from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train_step import ASSETS, CONFIG, ENV, REPO  # noqa: E402  (the demo run's paths and environment)

RUN = ("import gc, runpy, sys, types; {patch}sys.argv = ['grpo_mega.train'] + sys.argv[1:]; "
       "runpy.run_module('grpo_mega.train', run_name='__main__')")
UNFROZEN = ("import grpo_mega.rollout.engine as E; "  # only the engine's own freeze; vLLM's stays
            "E.gc = types.SimpleNamespace(freeze=lambda: None, unfreeze=gc.unfreeze); ")


def args(run_dir: str) -> list[str]:
    return ["--config", str(CONFIG),
            f"--model.hf_checkpoint={ASSETS / 'hf'}", f"--data.train_path={ASSETS / 'train.jsonl'}",
            f"--data.eval_path={ASSETS / 'eval.jsonl'}", f"--logging.run_dir={run_dir}",
            "--algorithm.steps=2", "--data.eval_every=0", "--data.prompts_per_step=4",
            "--parallel.micro_batch_size=4", "--checkpoint.save_every=0",
            "--algorithm.time_limit_minutes=0", "--logging.tensorboard=false", "--parallel.tp=1"]


def one(frozen: bool) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one two-step run in a fresh interpreter."""
    code = RUN.format(patch="" if frozen else UNFROZEN)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as run_dir:
        r = subprocess.run([sys.executable, "-c", code, *args(run_dir)], cwd=REPO, env=ENV,
                           capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"the run failed:\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for i in range(a.repeats):
        for frozen in (False, True):
            cpu, wall = one(frozen)
            runs[frozen].append((cpu, wall))
            print(f"[{i + 1}/{a.repeats}] {'frozen  ' if frozen else 'unfrozen'} cpu {cpu:6.2f} s  wall {wall:6.2f} s",
                  flush=True)
    med = {k: (statistics.median(c for c, _ in v), statistics.median(w for _, w in v)) for k, v in runs.items()}
    print(f"two-step demo run, median of {a.repeats}: unfrozen cpu {med[False][0]:.2f} s wall {med[False][1]:.2f} s; "
          f"frozen cpu {med[True][0]:.2f} s wall {med[True][1]:.2f} s; "
          f"ratio cpu {med[True][0] / med[False][0]:.2f}x wall {med[True][1] / med[False][1]:.2f}x")


if __name__ == "__main__":
    main()
