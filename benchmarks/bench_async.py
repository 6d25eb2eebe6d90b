"""Benchmark: asynchronous GRPO against the synchronous loop on this machine (2 cores).

The demo task (two-digit addition, the packaged tiny Qwen2), rollout-heavy: 16 samples per
prompt, so that generation is at least a third of a synchronous step. Each run trains
--steps steps from the same weights and data and reports

  tokens/s      consumed (trained) prompt + response tokens per second of training, from
                the first step's start to the last step's end (``metrics.jsonl`` times;
                start-up and the initial evaluation are excluded, the same for every run)
  gen share     the rollout stage's share of a step (synchronous runs)
  accuracy      held-out greedy accuracy after the last step (``summary.json``)

Runs (pick with --runs):

  sync-w1       colocated, one process (the engine and the trainer take turns on one core)
  sync-dp2      colocated, torchrun world 2 = DP 2, an engine in each rank (both cores)
  async-s1      ``rollout.placement: separate`` (one engine process pinned to one core, the
                trainer on the other), ``algorithm.max_staleness: 1``, no behaviour
                correction (``algorithm.tis_mode: off``, the default before issue 40)
  async-s1-cap  the same with the importance weight clamped at 2 (``tis_cap: 2, tis_mode: clamp``)
  async-s1-default  the same with the default correction (AReaL's mask at 5.0)
  async-dp2-s1  the trainer at DP 2 (both cores) and the engine process beside it (3 processes),
                no correction

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_async.py --steps 40
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "grpo_mega" / "assets" / "demo_v1"
RUNS = {
    "sync-w1": ([], 1),
    "sync-dp2": ([], 2),
    "async-s1": (["--rollout.placement=separate", "--algorithm.max_staleness=1", "--algorithm.tis_mode=off"], 1),
    "async-s1-cap": (["--rollout.placement=separate", "--algorithm.max_staleness=1", "--algorithm.tis_cap=2",
                      "--algorithm.tis_mode=clamp"], 1),
    "async-s1-default": (["--rollout.placement=separate", "--algorithm.max_staleness=1"], 1),
    "async-dp2-s1": (["--rollout.placement=separate", "--algorithm.max_staleness=1", "--algorithm.tis_mode=off"], 2),
}


def _cmd(run: Path, steps: int, extra: list[str], world: int, samples: int) -> list[str]:
    args = ["--config", str(REPO / "grpo_mega" / "configs" / "demo.yaml"), "--parallel.tp=1",
            f"--model.hf_checkpoint={ASSETS / 'hf'}", f"--data.train_path={ASSETS / 'train.jsonl'}",
            f"--data.eval_path={ASSETS / 'eval.jsonl'}", f"--logging.run_dir={run}",
            f"--algorithm.steps={steps}", "--data.eval_every=0", f"--rollout.n={samples}",
            "--checkpoint.save_every=0", "--algorithm.time_limit_minutes=0", "--logging.tensorboard=false",
            "--logging.progress=false", *extra]
    if world == 1:
        return [sys.executable, "-m", "grpo_mega.train", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
            "-m", "grpo_mega.train", *args]


def measure(name: str, steps: int, samples: int, root: Path) -> dict:
    extra, world = RUNS[name]
    run = root / name
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
               PYTHONWARNINGS="ignore", PYTHONPATH=str(REPO))
    r = subprocess.run(_cmd(run, steps, extra, world, samples), cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=3600)
    if r.returncode:
        raise SystemExit(f"{name} failed:\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = sorted((x for x in rows if "reward_mean" in x), key=lambda x: x["step"])
    secs = lambda x: sum(v for k, v in x.items() if k.startswith("time/"))  # noqa: E731
    # tokens_per_s is the step's tokens over its wall time; the step's own tokens back from it.
    tokens = sum(x["tokens_per_s"] * secs(x) for x in rows)
    wall = rows[-1]["time"] - rows[0]["time"] + secs(rows[0])
    gen = sum(x.get("time/rollout", 0.0) for x in rows) / max(sum(secs(x) for x in rows), 1e-9)
    summary = json.loads((run / "summary.json").read_text())
    return {"run": name, "steps": len(rows), "tokens_per_s": tokens / wall, "gen_share": gen,
            "accuracy": summary["eval_accuracy_final"], "initial": summary["eval_accuracy_initial"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--samples", type=int, default=16, help="rollout.n (rollout-heavy: 16)")
    ap.add_argument("--runs", default="sync-w1,sync-dp2,async-s1")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp:
        results = [measure(n, a.steps, a.samples, Path(tmp)) for n in a.runs.split(",")]
    best_sync = max((r for r in results if r["run"].startswith("sync")), key=lambda r: r["tokens_per_s"],
                    default=None)
    print(f"{'run':10s} {'tokens/s':>9s} {'gen share':>9s} {'accuracy':>17s}")
    for r in results:
        ratio = f"  {r['tokens_per_s'] / best_sync['tokens_per_s']:.2f}x best sync" if best_sync else ""
        print(f"{r['run']:10s} {r['tokens_per_s']:9.0f} {r['gen_share']:9.1%} "
              f"{r['initial']:7.1%} -> {r['accuracy']:6.1%}{ratio}")


if __name__ == "__main__":
    main()
