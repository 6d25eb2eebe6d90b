"""GRPO step benchmark: seconds per step by stage, tokens/s, and what the idle engine costs.

    python benchmarks/bench_train_step.py --steps 30                # TP=1 and TP=2 demo runs
    python benchmarks/bench_train_step.py --idle-engine             # update with/without engine

Part 1 runs the demo config for a fixed number of steps at TP=1 (one process)
and TP=2 (torchrun, 2 ranks) and prints the median seconds per stage read from
each run's metrics.jsonl (the first 3 steps are warm-up, excluded). docs/evidence/benchmarks-2026-11.md's
"before" rows (the redundant old-policy forward forced on) are historical: the
loop no longer has a switch for it.

Part 2 times the policy-update stage on a fixed batch in one process, first
with no vLLM engine, then with a child-process engine alive and idle, then
after shutting it down, and prints the ratio (the issue's bar: <= 1.10).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ASSETS = REPO / "grpo_mega" / "assets" / "demo_v1"
CONFIG = REPO / "grpo_mega" / "configs" / "demo.yaml"
ENV = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
           PYTHONWARNINGS="ignore")
STAGES = ("rollout", "reward", "advantage", "logprobs", "update", "sync")


def run_demo(tp: int, steps: int) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix=f"bench_tp{tp}_"))
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                 "--standalone"] if tp == 2 else [sys.executable])
    cmd = launcher + ["-m", "grpo_mega.train", "--config", str(CONFIG), f"--parallel.tp={tp}",
                      f"--model.hf_checkpoint={ASSETS / 'hf'}", f"--data.train_path={ASSETS / 'train.jsonl'}",
                      f"--data.eval_path={ASSETS / 'eval.jsonl'}", f"--logging.run_dir={run_dir}",
                      f"--algorithm.steps={steps}", "--data.eval_every=0", "--checkpoint.save_every=0",
                      "--algorithm.time_limit_minutes=0", "--logging.tensorboard=false"]
    subprocess.run(cmd, env=ENV, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward_mean" in r][3:]
    out = {s: statistics.median(r.get(f"time/{s}", 0.0) for r in rows) for s in STAGES}
    out["step"] = sum(out[s] for s in STAGES)
    out["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in rows)
    return out


def part1(steps: int) -> None:
    print(f"demo config, {steps} steps, median over steps 4..{steps} (seconds)")
    head = f"{'layout':<8}" + "".join(f"{s:>10}" for s in STAGES) + f"{'step':>8}{'tok/s':>8}"
    print(head)
    for tp in (1, 2):
        r = run_demo(tp, steps)
        print(f"{'TP=' + str(tp):<8}" + "".join(f"{r[s]:>10.3f}" for s in STAGES)
              + f"{r['step']:>8.3f}{r['tokens_per_s']:>8.0f}", flush=True)


def part2(iters: int) -> None:
    import torch
    from grpo_mega.config import load_config
    from grpo_mega.trainer.batch import TrainingBatch
    from grpo_mega.trainer.passes import update_policy
    from grpo_mega.models import build_model
    from grpo_mega.optim.adamw import ParallelAdamW
    from grpo_mega.distributed.state import init_parallel
    from grpo_mega.preflight.shape import model_shape_from_hf

    cfg = load_config(str(CONFIG), [f"--model.hf_checkpoint={ASSETS / 'hf'}", "--parallel.tp=1",
                                    "--algorithm.kl_coef=0"])
    model_shape_from_hf(cfg)
    ps = init_parallel(1, 1)
    model = build_model(cfg.model, ps)
    opt = ParallelAdamW(model, cfg.optimizer, ps)
    g = torch.Generator().manual_seed(0)
    prompts, responses, adv = [], [], []
    for _ in range(64):
        prompts.append(torch.randint(4, 16, (6,), generator=g).tolist())
        responses.append(torch.randint(4, 16, (4,), generator=g).tolist())
        adv.append(float(torch.randn((), generator=g)))
    micro = TrainingBatch.pack(prompts, responses, [[-1.0] * 4] * 64, adv, pad_id=3,
                               device=ps.device).split(32)

    def timed() -> float:
        ts = []
        for _ in range(iters):
            t0 = time.perf_counter()
            update_policy(model, opt, micro, ps, cfg.algorithm, vocab_size=cfg.model.vocab_size,
                          temperature=1.0, max_len=5, reuse_current_as_old=True)
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    timed()  # warm-up
    absent = timed()
    from grpo_mega.rollout import EngineConfig, RolloutEngine, SamplingConfig
    # A child-process engine: the case where an idle engine could steal a core from the
    # trainer. (An in-process engine in a 1-rank world disturbs megatron's groups here;
    # the colocated TP=2 demo uses external_launcher, whose engine runs only inside
    # generate calls.)
    engine = RolloutEngine(EngineConfig(model=str(ASSETS / "hf"), mode="child", max_model_len=32),
                           SamplingConfig(n=8, max_new_tokens=5, seed=0))
    engine.generate([[5, 6, 7]])  # the engine has served a request and now sits idle
    alive = timed()
    engine.shutdown()
    absent2 = timed()
    base = (absent + absent2) / 2
    print(f"update stage, median of {iters} (s): engine absent {absent:.4f} / {absent2:.4f}, "
          f"engine alive and idle {alive:.4f}; ratio {alive / base:.3f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--idle-engine", action="store_true", help="only the idle-engine measurement")
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    os.environ.update(OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    if args.idle_engine:
        part2(args.iters)
    else:
        part1(args.steps)
