"""Wall time per GRPO step, this checkout against a baseline checkout, side by side.

    git worktree add /tmp/grpo-baseline 4d5454a          # the "before" tree
    python benchmarks/bench_step_wall.py --baseline /tmp/grpo-baseline --steps 80 --rounds 3

Runs the demo config (no evaluation, no checkpoint, no tensorboard) for ``--steps`` steps
at TP=1 (one process) and TP=2 (torchrun, 2 ranks) from both trees, alternating
baseline / this tree within each round so machine load falls on both alike. A step's wall
time is the gap between consecutive ``time`` stamps in ``metrics.jsonl``: everything
between two steps, logging and metric gathering included. The first 3 steps of a run
are warm-up and not counted. Prints, per layout and tree, the median wall seconds per
step, the median of each stage timer and the rest (wall minus the stages), then the
ratio this tree / baseline of the median wall time.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
           PYTHONWARNINGS="ignore", TORCH_CPP_LOG_LEVEL="ERROR")
STAGES = ("rollout", "reward", "advantage", "logprobs", "update", "sync")


def run(tree: Path, tp: int, steps: int) -> list[dict]:
    """One demo run from ``tree``; its per-step metric rows."""
    assets = tree / "grpo_mega" / "assets" / "demo_v1"
    run_dir = Path(tempfile.mkdtemp(prefix=f"wall_tp{tp}_"))
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]
                if tp == 2 else [sys.executable])
    cmd = launcher + ["-m", "grpo_mega.train", "--config", str(tree / "grpo_mega/configs/demo.yaml"),
                      f"--parallel.tp={tp}", f"--model.hf_checkpoint={assets / 'hf'}",
                      f"--data.train_path={assets / 'train.jsonl'}", f"--data.eval_path={assets / 'eval.jsonl'}",
                      f"--logging.run_dir={run_dir}", f"--algorithm.steps={steps}", "--data.eval_every=0",
                      "--checkpoint.save_every=0", "--algorithm.time_limit_minutes=0",
                      "--logging.tensorboard=false", "--logging.progress=false"]
    env = dict(ENV, PYTHONPATH=str(tree))
    subprocess.run(cmd, env=env, cwd=tree, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward_mean" in r]


def summarise(rows: list[dict]) -> dict[str, float]:
    """Median wall seconds per step (from step 4 on), median stage timers, and the rest."""
    walls = [b["time"] - a["time"] for a, b in zip(rows[2:], rows[3:])]
    out = {s: statistics.median(r.get(f"time/{s}", 0.0) for r in rows[3:]) for s in STAGES}
    out["stages"] = statistics.median(sum(v for k, v in r.items() if k.startswith("time/")) for r in rows[3:])
    out["wall"] = statistics.median(walls)
    out["rest"] = statistics.median(w - sum(v for k, v in r.items() if k.startswith("time/"))
                                    for w, r in zip(walls, rows[3:]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", type=Path, required=True, help="checkout of the 'before' tree")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--rounds", type=int, default=3, help="baseline/this pairs per layout")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    args = ap.parse_args()
    trees = {"baseline": args.baseline.resolve(), "this": REPO}
    head = f"{'layout':<7}{'tree':<10}" + "".join(f"{s:>10}" for s in STAGES) + f"{'rest':>8}{'wall':>8}"
    print(f"demo config, {args.steps} steps x {args.rounds} rounds per tree; median seconds per step "
          "(steps 4 on; the median over rounds of each run's median)")
    print(head, flush=True)
    for tp in args.tp:
        pooled: dict[str, list[dict]] = {k: [] for k in trees}
        for k in range(args.rounds):
            order = list(trees) if k % 2 == 0 else list(trees)[::-1]  # alternate who goes first
            for name in order:
                rows = run(trees[name], tp, args.steps)
                pooled[name].append(rows)
        res = {}
        for name in trees:
            per_run = [summarise(rows) for rows in pooled[name]]
            res[name] = {key: statistics.median(p[key] for p in per_run) for key in per_run[0]}
            r = res[name]
            print(f"{'TP=' + str(tp):<7}{name:<10}" + "".join(f"{r[s]:>10.3f}" for s in STAGES)
                  + f"{r['rest']:>8.3f}{r['wall']:>8.3f}", flush=True)
        walls = {name: [summarise(rows)["wall"] for rows in pooled[name]] for name in trees}
        print(f"TP={tp}: wall per step this/baseline = {res['this']['wall'] / res['baseline']['wall']:.3f} "
              f"(per-round walls: baseline {[round(w, 3) for w in walls['baseline']]}, "
              f"this {[round(w, 3) for w in walls['this']]})", flush=True)


if __name__ == "__main__":
    main()
