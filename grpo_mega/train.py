"""GRPO training: the main job.

    torchrun --nproc-per-node 2 -m grpo_mega.train --config grpo_mega/configs/demo.yaml

One step, as named and timed stages (DeepSeekMath GRPO, no critic), in
``grpo_mega/trainer/stages.py``:
  rollout    G samples per prompt from the vLLM engine (sampled-token logprobs kept)
  reward     rule-based scores, in a process pool with a per-sample timeout
  refill     with DAPO dynamic sampling: drop groups without a reward spread and sample
             more rounds (rollout + reward) until enough groups have one
  advantage  group-normalised rewards (z-score / Dr. GRPO / RLOO) -> one TrainingBatch
  logprobs   reference (KL) and, when the update goes off-policy, old-policy
             log-probs: forward-only through the pipeline, vocab-parallel
  update     ppo_epochs x mini-batches through the pipeline schedule, clipped
             surrogate + KL, global-norm clipping
  sync       trainer weights -> engine in place, verified
  ref_reset  every algorithm.ref_reset_every steps the KL reference <- the policy
  log / checkpoint
  export_hf  the trained weights as a Hugging Face directory in <run_dir>/hf (checkpoint.export_hf)

Re-running the same command resumes from the latest checkpoint.
"""
from __future__ import annotations

import math
import os
import sys
import time

from grpo_mega.runtime import console, lifeline

if __name__ == "__mp_main__":  # a multiprocessing child of a rank re-imports this module first
    lifeline.watch_spawning_parent()
if __name__ == "__main__":  # before torch loads: it reads TORCH_CPP_LOG_LEVEL only then
    console.quiet_third_party(console.verbose_requested(sys.argv[1:]))

# A spawn child of a rank (reward worker, checkpoint writer, vLLM engine core) runs this
# module as __mp_main__ before it unpickles its target, which lives elsewhere: the trainer's
# imports below cost each child about 1.5 CPU-seconds (torch, the stages, triton) it never
# uses, several children per rank, every launch. They load in the rank only.
if __name__ != "__mp_main__":
    import torch  # noqa: E402
    import torch.distributed as dist  # noqa: E402

    from grpo_mega.runtime import faults  # noqa: E402
    from grpo_mega.trainer import stages as S  # noqa: E402
    from grpo_mega.trainer.pipeline import RolloutPipeline  # noqa: E402
    from grpo_mega.trainer.stages import stage  # noqa: E402
    from grpo_mega.trainer.trainer import Trainer, build_trainer  # noqa: E402


def grpo_step(t: Trainer, step: int) -> dict:
    timings: dict[str, float] = {}
    start = time.perf_counter()
    faults.set_step(step)
    faults.fault_point("step")
    async_stats: dict = {}
    with stage("rollout", timings):
        if t.pipeline is not None:  # asynchronous: the batch the engines drew while we updated
            prompts, rollout, async_stats = t.pipeline.take(t, step)
        else:
            prompts, rollout = S.rollout(t, step)
    with stage("reward", timings):
        rewards, stats = S.reward(t, prompts, rollout)
    stats.update(async_stats)
    if t.cfg.algorithm.dynamic_sampling:  # DAPO: further rounds until enough groups have signal
        rollout, rewards = S.refill(t, step, rollout, rewards, stats, timings)
    with stage("advantage", timings):
        batch = S.advantage(t, rollout, rewards)
    if t.cfg.logging.record_batches:
        S.record(t, step, batch)
    metrics: dict = {"empty_step": 1.0}  # no group had a reward spread: nothing to learn from
    with stage("release", timings):
        S.release_engine(t)
    if len(batch):
        with stage("logprobs", timings):
            plan = S.logprobs(t, batch)
        with stage("update", timings):
            metrics = S.update(t, plan)
    with stage("resume", timings):
        S.resume_engine(t)
    with stage("sync", timings):
        gbps = S.sync(t)
    if t.pipeline is not None:  # the next prompts start on the weights just synced
        with stage("submit", timings):
            t.pipeline.fill(t, step + 1, t.cfg.algorithm.steps)
    metrics.update(S.gather_metrics(t, metrics), **stats, sync_gbps=gbps)
    if t.pipeline is not None:
        metrics.update(t.pipeline.update_metrics(t))
    metrics["tokens_per_s"] = batch.num_tokens * t.ps.dp / (time.perf_counter() - start)
    metrics["clipfrac"] = metrics.get("clipfrac_low", 0.0) + metrics.get("clipfrac_high", 0.0)
    metrics.update({f"time/{k}": v for k, v in timings.items()})
    return metrics


def save(t: Trainer, final: bool = False) -> None:
    """Checkpoint (and HF export when due) with the engine released (issue 39): on a
    colocated GPU whose engine sleeps between rollouts, the save's buffers use the memory
    the engine's weights and KV cache free. A level-2 sleep discarded the engine's weights,
    so a periodic save wakes it and syncs again; the final one leaves it asleep."""
    sleeps = t.cfg.rollout.placement != "separate" and t.cfg.rollout.sleep_between_rollouts
    if sleeps:
        S.release_engine(t)
    S.checkpoint(t)
    S.export_hf(t, periodic=not final)
    if sleeps and not final:
        S.resume_engine(t)
        S.sync(t)


def _agreed_elapsed(t: Trainer) -> float:
    """Wall time since start as rank 0 sees it, so every rank stops at the same step."""
    v = torch.tensor([time.time() - t.started], dtype=torch.float64, device=t.ps.device)
    if t.ps.world_size > 1:
        dist.broadcast(v, src=0)
    return float(v)


def run(t: Trainer) -> dict:
    cfg = t.cfg
    steps, every = cfg.algorithm.steps, cfg.data.eval_every
    if t.step == 0 and t.eval_initial is None:
        t.eval_initial = S.evaluate(t, 0)
        S.log(t, 0, {"eval_accuracy": t.eval_initial})
    bad_steps, last_eval = 0, t.eval_last
    limit = cfg.algorithm.time_limit_minutes * 60
    bar = console.bar(total=steps, initial=t.step, desc="[grpo] steps", unit="step",
                      enabled=cfg.logging.progress and t.ps.rank == 0)
    if cfg.rollout.placement == "separate":  # the batches of the next S + 1 steps stay in flight
        t.pipeline = RolloutPipeline(cfg.algorithm.max_staleness)
        if cfg.algorithm.max_staleness and cfg.algorithm.tis_mode == "off":
            t.say("warning: algorithm.max_staleness >= 1 with algorithm.tis_mode=off trains stale samples with "
                  "no importance correction (measured: 10 points lower held-out accuracy on the demo); "
                  "drop --algorithm.tis_mode=off")
        t.pipeline.fill(t, t.step + 1, steps)
    while t.step < steps:
        if limit and _agreed_elapsed(t) > limit:
            t.say(f"time limit of {cfg.algorithm.time_limit_minutes} min reached at step {t.step}")
            steps = t.step
            last_eval = t.eval_last = S.evaluate(t, t.step)
            S.log(t, t.step, {"eval_accuracy": last_eval})
            break
        t.step += 1
        m = grpo_step(t, t.step)
        bad_steps = bad_steps + 1 if m.get("skipped") or not math.isfinite(m.get("loss", 0.0)) else 0
        if m.get("empty_step"):
            t.say(f"step {t.step}: empty step, no group had a reward spread after "
                  f"{m.get('dapo_rounds', 1):.0f} sampling rounds; no update "
                  "(raise --algorithm.dynamic_sampling_max_rounds)")
        if bad_steps:
            t.say(f"step {t.step}: non-finite loss or gradient; update skipped ({bad_steps} in a row)")
        if bad_steps >= 3:
            raise RuntimeError(f"{bad_steps} consecutive steps with NaN/inf; stopping. The last good "
                               f"checkpoint is kept in {t.ckpt_dir} (lower --optimizer.lr?)")
        if S.reset_reference(t):  # iterative GRPO: reference <- current policy
            m["ref_reset"] = 1.0
        if (every and t.step % every == 0) or t.step == steps:  # the final one always runs
            last_eval = m["eval_accuracy"] = S.evaluate(t, t.step)
        t.eval_last = last_eval
        S.log(t, t.step, m)
        bar.set_postfix(S.bar_metrics(m), refresh=False)
        bar.update(1)
        if cfg.checkpoint.save_every and t.step % cfg.checkpoint.save_every == 0 and t.step < steps:
            with stage("checkpoint", {}):
                save(t)
    bar.close()
    save(t, final=True)
    return t.finish()


def refused_once(e: Exception) -> bool:
    """A refusal of the input (config, data, tokenizer) before any process group: every
    rank found the same cause, so one line on each node's first rank (the launcher's log of
    that node), no traceback, and True; other errors are left to the caller."""
    from grpo_mega.config import ConfigError
    from grpo_mega.data import DataError
    from grpo_mega.data.tokenizer import TokenizerError

    if not isinstance(e, (ConfigError, DataError, TokenizerError)) or dist.is_initialized():
        return False
    if os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")) == "0":
        kind = "data error" if isinstance(e, DataError) else "config error"
        print(f"[grpo] {kind}: {e}", file=sys.stderr, flush=True)
    return True


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    os.environ[lifeline.PARENT_ENV] = str(os.getpid())  # our spawn children watch us (__mp_main__)
    if lifeline.launched_by_launcher():  # torchrun puts ranks in their own sessions: a killed
        lifeline.watch_parent("torchrun agent", label=f"rank {os.environ.get('RANK', '0')}")  # agent orphans them
    t = build_trainer(["--logging.verbose=true" if a == "--verbose" else a for a in argv])
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
        if refused_once(e):
            sys.exit(2)
        rank = os.environ.get("RANK", "0")
        print(f"[grpo] rank {rank} FAILED: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        if os.environ.get("GRPO_TRACEBACK", "1") == "1":
            raise
        sys.exit(1)
