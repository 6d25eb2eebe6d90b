"""The stages of one GRPO step, each a plain function of the ``Trainer``.

``train.py`` calls them in order and times each under its name (``stage``):
rollout -> reward -> advantage -> logprobs -> update -> sync -> log, plus
evaluate, the iterative-GRPO reference reset and checkpoint. Data flows down once: the rollout's token lists and the
rewards become one ``TrainingBatch`` on the device in ``advantage``; everything
after that works on slices of it.

The rollout engine holds its memory only while it is used: every generation and
every weight load is bracketed by ``engine.resume()`` / ``engine.release()``, so
the update runs with the engine released.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Optional

import torch
import torch.distributed as dist

from grpo_mega import algorithms as A
from grpo_mega import models
from grpo_mega.algorithms.vocab_parallel_triton import use_fused
from grpo_mega.models.precision import seq_multiple
from grpo_mega.trainer.batch import (TrainingBatch, compute_logprobs, metrics_to_floats,
                                     update_policy)

if TYPE_CHECKING:
    from grpo_mega.data import Prompt
    from grpo_mega.rollout import RolloutBatch, SamplingConfig
    from grpo_mega.trainer.trainer import Trainer


@contextlib.contextmanager
def stage(name: str, timings: dict[str, float]) -> Iterator[None]:
    """Time a named stage (seconds accumulate under ``timings[name]``)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - start


def _generate(t: Trainer, prompts: list[Prompt], step: int,
              sampling: Optional[SamplingConfig] = None) -> RolloutBatch:
    t.engine.resume()
    try:
        return t.engine.generate_for_replica(prompts, sampling, step=step)
    finally:
        t.engine.release()  # the trainer's phases get the memory back


# ------------------------------------------------------------------------- rollout

def rollout(t: Trainer, step: int) -> tuple[list[Prompt], RolloutBatch]:
    """G samples per prompt of this DP rank's share, with the sampled tokens' log-probs."""
    prompts = t.dataset.next_batch(t.cfg.data.prompts_per_step)
    return prompts, _generate(t, prompts, step)


# -------------------------------------------------------------------------- reward

def _score(t: Trainer, prompts: list[Prompt], batch: RolloutBatch) -> tuple[list[float], int]:
    """Rewards for this replica's samples, scored once on the replica leader and sent to
    the other model-parallel ranks; also the number of samples whose reward failed."""
    from grpo_mega.rewards import RewardSample

    scores, failures = None, 0
    if t.scorer is not None:
        samples = []
        for i in range(len(batch)):
            p = prompts[batch.prompt_index[i]]
            meta = {"response_length": len(batch.response_ids[i]), "finish_reason": batch.finish_reasons[i]}
            samples.append(RewardSample(p.text, batch.texts[i], p.reference, {**p.metadata, **meta}))
        result = t.scorer.score(samples)
        scores, failures = result.scores, len(result.failures)
    if t.ps.world_size > 1 and t.ps.tp * t.ps.pp > 1:
        box = [(scores, failures)]
        dist.broadcast_object_list(box, src=t.leader_rank, group=t.ps.mp_group)
        scores, failures = box[0]
    return [float(s) for s in scores], failures


def reward(t: Trainer, prompts: list[Prompt], batch: RolloutBatch) -> tuple[list[float], dict[str, float]]:
    """Rewards of this replica's samples, and reward / accuracy / length statistics over
    the global batch (all replicas)."""
    rewards, failures = _score(t, prompts, batch)
    r = torch.tensor(rewards, dtype=torch.float64)
    lens = torch.tensor(batch.response_lengths, dtype=torch.float64)
    truncated = sum(f == "length" for f in batch.finish_reasons)
    v = torch.tensor([r.sum(), (r * r).sum(), float(len(r)), (r >= 1.0).sum(), lens.sum(), truncated],
                     dtype=torch.float64)
    if t.ps.dp > 1:
        dist.all_reduce(v, group=t.ps.dp_group)
    n = max(float(v[2]), 1.0)
    mean = float(v[0]) / n
    return rewards, {"reward_mean": mean, "reward_std": math.sqrt(max(float(v[1]) / n - mean * mean, 0.0)),
                     "accuracy": float(v[3]) / n, "response_len": float(v[4]) / n,
                     "truncated_frac": float(v[5]) / n, "reward_failures": float(failures)}


# ----------------------------------------------------------------------- advantage

def advantage(t: Trainer, batch: RolloutBatch, rewards: list[float],
              stats: dict[str, float]) -> TrainingBatch:
    """Group-normalised advantages, the optional DAPO filter of uniform groups (counted in
    ``stats``), and the step's ``TrainingBatch`` on the trainer's device."""
    algo = t.cfg.algorithm
    adv = A.group_advantages(torch.tensor(rewards), t.cfg.rollout.n, norm=algo.norm, baseline=algo.baseline)
    keep = list(range(len(batch)))
    if algo.dynamic_sampling:
        from grpo_mega.rewards import filter_uniform_groups
        kept = filter_uniform_groups(rewards, t.cfg.rollout.n)
        stats["groups_dropped"] = float(kept.num_dropped)
        keep = list(kept.sample_indices)
    return TrainingBatch.pack([batch.prompt_ids[i] for i in keep], [batch.response_ids[i] for i in keep],
                              [batch.logprobs[i] for i in keep], adv[keep], pad_id=t.pad_id,
                              device=t.ps.device, pad_to_multiple=seq_multiple(t.cfg.model))


# ------------------------------------------------------------------------ logprobs

@dataclass
class UpdatePlan:
    """The mini-batches of one step, each split into micro-batches (all views of one batch)."""

    minis: list[list[TrainingBatch]]
    off_policy: bool

    @property
    def flat(self) -> list[TrainingBatch]:
        return [mb for ms in self.minis for mb in ms]


def _kernel_kw(t: Trainer) -> dict:
    return dict(vocab_size=t.cfg.model.vocab_size, temperature=t.temperature,
                fused=use_fused(t.cfg.algorithm.logprob_kernel, t.ps.device))


def logprobs(t: Trainer, batch: TrainingBatch) -> UpdatePlan:
    """Reference (KL) and, when the update goes off-policy, old-policy log-probs, written
    into ``batch``. With one PPO epoch, one mini-batch and no TIS the old log-probs equal
    the current ones at update time, so that forward is skipped."""
    cfg, ps, algo = t.cfg, t.ps, t.cfg.algorithm
    per_rank_mini = (cfg.data.mini_batch_size or cfg.data.prompts_per_step * cfg.rollout.n) // ps.dp
    off_policy = algo.ppo_epochs > 1 or len(batch) > per_rank_mini or algo.tis_cap is not None
    if t.ref is not None:
        batch.ref_logp = batch.empty_logp()
    if off_policy:
        batch.old_logp = batch.empty_logp()
    # Slice after allocating, so the micro-batch views alias the buffers filled below.
    plan = UpdatePlan([m.split(cfg.parallel.micro_batch_size) for m in batch.split(per_rank_mini)], off_policy)
    kw = _kernel_kw(t)
    if t.ref is not None:
        offload = cfg.checkpoint.offload_reference  # keep the frozen copy off the GPU between uses
        if offload:
            models.offload(t.ref, ps.device)
        compute_logprobs(t.ref, plan.flat, ps, key="ref_logp", **kw)
        if offload:
            models.offload(t.ref, torch.device("cpu"))
    if off_policy:
        compute_logprobs(t.model, plan.flat, ps, key="old_logp", **kw)
    return plan


# -------------------------------------------------------------------------- update

def update(t: Trainer, plan: UpdatePlan) -> dict[str, float]:
    """ppo_epochs x mini-batches of clipped surrogate + KL, one optimizer step each; the
    last step's metrics, as floats (the step's one host sync of the metrics)."""
    metrics: dict = {}
    for _ in range(t.cfg.algorithm.ppo_epochs):
        for micro in plan.minis:
            metrics = update_policy(t.model, t.optimizer, micro, t.ps, t.cfg.algorithm,
                                    max_len=t.cfg.rollout.max_new_tokens,
                                    reuse_current_as_old=not plan.off_policy, **_kernel_kw(t))
            t.scheduler.step()
    return metrics_to_floats(metrics)


# ------------------------------------------------------------------------ ref_reset

def reset_reference(t: Trainer) -> bool:
    """Iterative GRPO (DeepSeekMath, Algorithm 1): at the end of every
    ``algorithm.ref_reset_every``-th step the reference becomes the current policy,
    copied in place (into the CPU copy under ``checkpoint.offload_reference``). From
    then on checkpoints store the reference. Returns whether it was reset."""
    k = t.cfg.algorithm.ref_reset_every
    if t.ref is None or k <= 0 or t.step % k:
        return False
    t.ref.load_state_dict(t.model.state_dict())
    t.ref_reset_step = t.step
    return True


# ---------------------------------------------------------------------------- sync

def sync(t: Trainer) -> float:
    """Trainer weights -> engine in place (verified when configured); returns GB/s."""
    t.engine.resume()
    try:
        return t.bridge.sync().gbps
    finally:
        t.engine.release()


# ----------------------------------------------------------------------------- log

def gather_metrics(t: Trainer, metrics: dict[str, float]) -> dict[str, float]:
    """Bring the last stage's (DP rank 0, TP rank 0) update metrics to every rank."""
    if t.ps.world_size == 1:
        return metrics
    src = dist.get_global_rank(t.ps.pp_group, t.ps.pp - 1) if t.ps.pp > 1 else t.ps.rank
    box = [metrics if t.ps.is_last_stage else None]
    if t.ps.pp > 1:
        dist.broadcast_object_list(box, src=src, group=t.ps.pp_group)
    return box[0] or {}


def log(t: Trainer, step: int, metrics: dict) -> None:
    if t.sink is not None:
        t.sink.log(step, metrics)


# ------------------------------------------------------------------------ evaluate

def evaluate(t: Trainer, step: int) -> float:
    """Held-out accuracy: greedy (eval_samples=1) or pass@k at the rollout temperature."""
    from grpo_mega.rollout import SamplingConfig

    k = t.cfg.data.eval_samples
    prompts = list(t.eval_set.prompts)
    prompts = prompts[:len(prompts) - len(prompts) % t.ps.dp]
    s = SamplingConfig(n=k, temperature=0.0 if k == 1 else t.cfg.rollout.temperature,
                       max_new_tokens=t.cfg.rollout.max_new_tokens, stop=tuple(t.cfg.rollout.stop),
                       seed=t.cfg.rollout.seed + 7919)
    batch = _generate(t, prompts, step, s)
    rewards, _ = _score(t, prompts, batch)
    solved: dict[int, bool] = {}
    for i, r in enumerate(rewards):
        solved[batch.prompt_index[i]] = solved.get(batch.prompt_index[i], False) or r >= 1.0
    v = torch.tensor([float(sum(solved.values())), float(len(solved))], dtype=torch.float64)
    if t.ps.dp > 1:
        dist.all_reduce(v, group=t.ps.dp_group)
    return float(v[0] / max(float(v[1]), 1.0))


# ---------------------------------------------------------------------- checkpoint

def checkpoint(t: Trainer) -> None:
    """Model, optimizer, data position, scheduler and eval results, resumable at any layout;
    the reference too once a reset has made it differ from the initial weights."""
    from grpo_mega.checkpoint import save_checkpoint

    common = {"model": dataclasses.asdict(t.cfg.model), "data": t.dataset.state_dict(),
              "scheduler": t.scheduler.state_dict(), "eval_initial": t.eval_initial,
              "eval_last": t.eval_last, "ref_reset_step": t.ref_reset_step}
    reference = t.ref if t.ref_reset_step is not None else None
    path = save_checkpoint(t.ckpt_dir, t.step, t.model, t.optimizer, t.ps,
                           json.loads(json.dumps(common, default=str)), keep_last=t.cfg.checkpoint.keep_last,
                           reference=reference)
    t.say(f"checkpoint saved: {path}")
