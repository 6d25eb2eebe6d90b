"""GRPO training: the main job.

    torchrun --nproc-per-node 2 -m grpo_mega.train --config grpo_mega/configs/demo.yaml

One step, as named and timed stages (DeepSeekMath GRPO, no critic):
  rollout    G samples per prompt from the vLLM engine (sampled-token logprobs kept)
  reward     rule-based scores, in a process pool with a per-sample timeout
  advantage  group-normalised rewards (z-score / Dr. GRPO / RLOO)
  logprobs   reference (KL) and, when the update goes off-policy, old-policy
             log-probs: forward-only through the pipeline, vocab-parallel
  update     ppo_epochs x mini-batches through the pipeline schedule, clipped
             surrogate + KL, global-norm clipping
  sync       trainer weights -> engine in place, verified
  log / checkpoint

Invariant worth knowing: with ppo_epochs=1, one mini-batch and no TIS, the
old-policy log-probs equal the current ones at update time, so that forward is
skipped (the ratio is exactly 1 and only its gradient matters).
Re-running the same command resumes from the latest checkpoint.
"""
from __future__ import annotations

import math
import os
import sys
import time

import torch
import torch.distributed as dist

from grpo_mega import algorithms as A
from grpo_mega import models
from grpo_mega.trainer.batch import Sample, compute_logprobs, make_micro_batches, update_policy
from grpo_mega.algorithms.vocab_parallel_triton import use_fused
from grpo_mega.models.precision import seq_multiple
from grpo_mega.trainer.trainer import Trainer, build_trainer, evaluate, save, stage


def rollout_and_score(t: Trainer, step: int, timings: dict) -> tuple[list[Sample], dict]:
    cfg = t.cfg
    with stage("rollout", timings):
        prompts = t.dataset.next_batch(cfg.data.prompts_per_step)
        batch = t.engine.generate_for_replica(prompts, step=step)
    with stage("reward", timings):
        rewards = t.score(prompts, batch)
    with stage("advantage", timings):
        adv = A.group_advantages(torch.tensor(rewards), cfg.rollout.n, norm=cfg.algorithm.norm,
                                 baseline=cfg.algorithm.baseline)
        samples = [Sample(list(p), list(r), list(lp), rw, float(a)) for p, r, lp, rw, a in
                   zip(batch.prompt_ids, batch.response_ids, batch.logprobs, rewards, adv)]
        stats = t.reward_stats(rewards, batch)
        if cfg.algorithm.dynamic_sampling:
            from grpo_mega.rewards import filter_uniform_groups
            kept = filter_uniform_groups(rewards, cfg.rollout.n)
            stats["groups_dropped"] = float(kept.num_dropped)
            samples = [samples[i] for i in kept.sample_indices]
    return samples, stats


def train_on(t: Trainer, samples: list[Sample], timings: dict) -> dict:
    cfg, ps, algo = t.cfg, t.ps, t.cfg.algorithm
    mbs = cfg.parallel.micro_batch_size
    per_rank_mini = (cfg.data.mini_batch_size or cfg.data.prompts_per_step * cfg.rollout.n) // ps.dp
    minis = [samples[i:i + per_rank_mini] for i in range(0, len(samples), per_rank_mini)]
    micro = [make_micro_batches(m, mbs, t.pad_id, seq_multiple(cfg.model)) for m in minis]
    flat = [mb for ms in micro for mb in ms]
    off_policy = (algo.ppo_epochs > 1 or len(minis) > 1 or algo.tis_cap is not None
                  or os.environ.get("GRPO_FORCE_OLD_LOGPROBS") == "1")  # benchmark's "before"
    kw = dict(vocab_size=cfg.model.vocab_size, temperature=t.temperature,
              fused=use_fused(algo.logprob_kernel, ps.device))
    with stage("logprobs", timings):
        if t.ref is not None and flat:
            offload = cfg.checkpoint.offload_reference  # keep the frozen copy off the GPU between uses
            if offload:
                models.offload(t.ref, ps.device)
            compute_logprobs(t.ref, flat, ps, key="ref_logp", **kw)
            if offload:
                models.offload(t.ref, torch.device("cpu"))
        if off_policy and flat:
            compute_logprobs(t.model, flat, ps, key="old_logp", **kw)
    metrics: dict = {}
    with stage("update", timings):
        for _ in range(algo.ppo_epochs):
            for ms in micro:
                if ms:
                    metrics = update_policy(t.model, t.optimizer, ms, ps, algo, max_len=cfg.rollout.max_new_tokens,
                                            reuse_current_as_old=not off_policy, **kw)
                    t.scheduler.step()
    return metrics


def grpo_step(t: Trainer, step: int) -> dict:
    timings: dict = {}
    start = time.perf_counter()
    samples, stats = rollout_and_score(t, step, timings)
    metrics = train_on(t, samples, timings) if samples else {"skipped": 1.0}
    with stage("sync", timings):
        sync = t.bridge.sync()
    metrics.update(t.gather_metrics(metrics), **stats, sync_gbps=sync.gbps)
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples) * t.ps.dp
    metrics["tokens_per_s"] = tokens / (time.perf_counter() - start)
    metrics["clipfrac"] = metrics.get("clipfrac_low", 0.0) + metrics.get("clipfrac_high", 0.0)
    metrics.update({f"time/{k}": v for k, v in timings.items()})
    return metrics


def _agreed_elapsed(t: Trainer) -> float:
    """Wall time since start as rank 0 sees it, so every rank stops at the same step."""
    v = torch.tensor([time.time() - t.started], dtype=torch.float64)
    if t.ps.world_size > 1:
        dist.broadcast(v, src=0)
    return float(v)


def run(t: Trainer) -> dict:
    cfg = t.cfg
    steps, every = cfg.algorithm.steps, cfg.data.eval_every
    if t.step == 0 and t.eval_initial is None:
        t.eval_initial = evaluate(t, 0)
        t.log(0, {"eval_accuracy": t.eval_initial})
    bad_steps, last_eval = 0, t.eval_last
    limit = cfg.algorithm.time_limit_minutes * 60
    while t.step < steps:
        if limit and _agreed_elapsed(t) > limit:
            t.say(f"time limit of {cfg.algorithm.time_limit_minutes} min reached at step {t.step}")
            steps = t.step
            last_eval = evaluate(t, t.step)
            t.eval_last = last_eval
            t.log(t.step, {"eval_accuracy": last_eval})
            break
        t.step += 1
        m = grpo_step(t, t.step)
        bad_steps = bad_steps + 1 if m.get("skipped") or not math.isfinite(m.get("loss", 0.0)) else 0
        if bad_steps:
            t.say(f"step {t.step}: non-finite loss or gradient; update skipped ({bad_steps} in a row)")
        if bad_steps >= 3:
            raise RuntimeError(f"{bad_steps} consecutive steps with NaN/inf; stopping. The last good "
                               f"checkpoint is kept in {t.ckpt_dir} (lower --optimizer.lr?)")
        if cfg.algorithm.ref_reset_every and t.step % cfg.algorithm.ref_reset_every == 0 and t.ref is not None:
            t.ref.load_state_dict(t.model.state_dict())  # iterative GRPO: ref <- current policy
        if (every and t.step % every == 0) or t.step == steps:  # the final one always runs
            last_eval = m["eval_accuracy"] = evaluate(t, t.step)
        t.eval_last = last_eval
        t.log(t.step, m)
        if cfg.checkpoint.save_every and t.step % cfg.checkpoint.save_every == 0 and t.step < steps:
            with stage("checkpoint", {}):
                save(t)
    save(t)
    return t.finish()


def main(argv=None) -> int:
    t = build_trainer(argv)
    try:
        summary = run(t)
        if t.ps.rank == 0:
            pct = lambda v: "n/a" if v is None else f"{v:.1%}"  # noqa: E731
            print(f"[grpo] done: held-out accuracy {pct(summary['eval_accuracy_initial'])} -> "
                  f"{pct(summary['eval_accuracy_final'])} in {summary['steps']} steps, "
                  f"{summary['wall_seconds']:.0f}s; run dir {t.cfg.logging.run_dir}", flush=True)
    finally:
        t.close()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as e:  # one readable line per failing rank; torchrun reports the exit code
        rank = os.environ.get("RANK", "0")
        print(f"[grpo] rank {rank} FAILED: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        if os.environ.get("GRPO_TRACEBACK", "1") == "1":
            raise
        sys.exit(1)
