"""The stages of one GRPO step, each a plain function of the ``Trainer``.

``train.py`` calls them in order and times each under its name (``stage``):
rollout -> reward -> advantage -> release -> logprobs -> update -> resume -> sync -> log, plus
evaluate, the iterative-GRPO reference reset and checkpoint, and with DAPO dynamic sampling
``refill`` (more rollout and reward rounds) before advantage. Data flows down once: the rollout's token lists and the
rewards become one ``TrainingBatch`` on the device in ``advantage``; everything
after that works on slices of it.

Memory between phases: the engine is awake from the weight sync through evaluation and
the next step's rollouts; ``release_engine`` (vLLM sleep level 2: weights and KV cache freed)
runs before the log-prob and update phases and ``resume_engine`` (wake_up) before the
sync, so the update never shares the GPU with the engine's share
(``rollout.sleep_between_rollouts``, the setting ``preflight.budget`` counts). The frozen
reference under ``checkpoint.offload_reference`` follows the same pattern around its
forward in ``logprobs``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Optional

import torch
import torch.distributed as dist

from grpo_mega import algorithms as A
from grpo_mega import models
from grpo_mega.algorithms.vocab_parallel_triton import use_fused
from grpo_mega.config import mini_batches_per_step
from grpo_mega.distributed.errors import run_on_src
from grpo_mega.runtime.faults import fault_point
from grpo_mega.models.precision import seq_multiple
from grpo_mega.trainer.dynamic_sampling import KeptGroups
from grpo_mega.trainer.microbatches import cut, plan_micro_batches
from grpo_mega.trainer.batch import TrainingBatch
from grpo_mega.trainer.passes import compute_logprobs, metrics_to_floats, update_policy

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


def _generate(t: Trainer, prompts: list[Prompt], step: int, sampling: Optional[SamplingConfig] = None,
              progress: bool = False, mini_batches: int = 1) -> RolloutBatch:
    """This DP replica's share of the samples of ``prompts``: of each of ``mini_batches``
    blocks of them, its share (``rollout.layout.prompt_slice``), so that every optimizer
    step sees the same prompts at every DP size."""
    if t.cfg.rollout.placement == "separate":  # engines in their own processes, fed by rank 0
        from grpo_mega.trainer.pipeline import generate_separate  # (episodes too, with env.name)
        return generate_separate(t, prompts, step, sampling, mini_batches)
    if t.episodes is not None:  # multi-turn: whole episodes against the environment
        from grpo_mega.trainer.episodes import play
        return play(t, prompts, step, sampling, mini_batches)
    if t.gateway is not None:  # an agent program plays them through the gateway
        from grpo_mega.trainer.gateway import play_gateway
        return play_gateway(t, prompts, step, sampling, mini_batches)
    t.engine.resume()  # a no-op unless something released it since the last sync
    return t.engine.generate_resharded(prompts, sampling, step=step, to_rank=t.ps.dp_rank,
                                       to_size=t.ps.dp, progress=progress, mini_batches=mini_batches)


# ------------------------------------------------------------------------- rollout

def rollout(t: Trainer, step: int, round: int = 0) -> tuple[list[Prompt], RolloutBatch]:
    """G samples per prompt of this DP rank's share, with the sampled tokens' log-probs.
    ``round`` > 0 is a DAPO refill round: the next prompts, with their own sampling seeds
    (asynchronous GRPO: the pipeline's next draw in flight, so draws stay in data order)."""
    if t.pipeline is not None:
        prompts, batch, _ = t.pipeline.take(t, step, round=round)
        return prompts, batch
    prompts = t.dataset.next_batch(t.cfg.data.prompts_per_step)
    sampling = None
    if round and t.engine.sampling.seed is not None:
        # Per-prompt seeds hash (seed, step, index): a refill round shifts the seed so its
        # prompts do not reuse the first round's random streams index for index.
        sampling = dataclasses.replace(t.engine.sampling, seed=t.engine.sampling.seed + round)
    fault_point("rollout.generate")
    return prompts, _generate(t, prompts, step, sampling, mini_batches=mini_batches_per_step(t.cfg))


def refill(t: Trainer, step: int, batch: RolloutBatch, rewards: list, stats: dict[str, float],
           timings: dict[str, float]) -> tuple[KeptGroups, list[float]]:
    """DAPO dynamic sampling: keep the groups with a reward spread and sample further rounds
    (timed as ``rollout`` and ``reward``) until ``data.prompts_per_step`` such groups are held
    over all replicas or ``algorithm.dynamic_sampling_max_rounds`` is reached; then this
    replica's equal share of them and its rewards. ``stats`` gets the reward statistics of
    every sampled round and the round and group counts."""
    from grpo_mega.trainer import dynamic_sampling as D

    n, target, cap = t.cfg.rollout.n, t.cfg.data.prompts_per_step, t.cfg.algorithm.dynamic_sampling_max_rounds
    dp_group = t.ps.dp_group if t.ps.dp > 1 else None
    kept, rounds, per_round = D.keep_groups(batch, rewards, n), 1, [dict(stats)]
    more, total = D.need_more_groups(kept.num_groups, target, rounds, cap, dp_group, t.ps.device)
    while more:
        with stage("rollout", timings):
            prompts, batch = rollout(t, step, round=rounds)
        with stage("reward", timings):
            rewards, round_stats = reward(t, prompts, batch)
        rounds += 1
        per_round.append(round_stats)
        if t.pipeline is not None:  # staleness over every draw the step took
            stats.update(t.pipeline.metrics)
        kept.extend(D.keep_groups(batch, rewards, n))
        more, total = D.need_more_groups(kept.num_groups, target, rounds, cap, dp_group, t.ps.device)
    mine = D.deal_groups(kept, target, t.ps.dp_rank, dp_group)
    used = mine.num_groups * t.ps.dp
    stats.update(_mean_over_rounds(per_round), dapo_rounds=float(rounds), groups_used=float(used),
                 groups_dropped=float(rounds * target - total),  # uniform: no signal
                 groups_spare=float(total - used))  # had signal, beyond the batch (or the DP cut)
    return mine, mine.rewards


def _mean_over_rounds(per_round: list[dict[str, float]]) -> dict[str, float]:
    """Reward statistics over all rounds (each round samples the same number of prompts, so
    plain means of the per-round means are exact; the std goes through the second moment)."""
    k = len(per_round)
    out = {key: sum(s[key] for s in per_round) / k
           for key in ("reward_mean", "accuracy", "response_len", "truncated_frac")}
    second = sum(s["reward_std"] ** 2 + s["reward_mean"] ** 2 for s in per_round) / k
    out["reward_std"] = math.sqrt(max(second - out["reward_mean"] ** 2, 0.0))
    out["reward_failures"] = sum(s["reward_failures"] for s in per_round)
    return out


# -------------------------------------------------------------------------- reward

def _score(t: Trainer, prompts: list[Prompt], batch: RolloutBatch) -> tuple[list, int]:
    """Rewards for this replica's samples, scored once on the replica leader and sent to
    the other model-parallel ranks; also the number of samples whose reward failed.
    With ``algorithm.advantage=process`` each reward is a ``StepScores``, else a float."""
    from grpo_mega.rewards import RewardSample

    if t.episodes is not None or t.gateway is not None:  # the environment (agent) scored each episode
        return list(batch.episode_rewards), 0

    def score() -> tuple[list, int]:
        fault_point("reward.score")
        samples = []
        for i in range(len(batch)):
            p = prompts[batch.prompt_index[i]]
            meta = {"response_length": len(batch.response_ids[i]), "finish_reason": batch.finish_reasons[i]}
            samples.append(RewardSample(p.text, batch.texts[i], p.reference, {**p.metadata, **meta}))
        result = t.scorer.score(samples)
        return _reward_values(t, result), len(result.failures)

    # A failure on the leader reaches the replica's other ranks as the same error, at
    # once, instead of leaving them in the broadcast until the collective timeout.
    shared = t.ps.world_size > 1 and t.ps.tp * t.ps.pp > 1
    return run_on_src(score, t.leader_rank, t.ps.mp_group if shared else None, "reward scoring")


def _reward_values(t: Trainer, result) -> list:
    """Each sample's StepScores (process supervision; a failed sample has no steps) or its
    float; a reward of the other kind stops the run, naming the functions and the flag."""
    from grpo_mega.rewards import StepScores

    process = t.cfg.algorithm.advantage == "process"
    names = [s.name for s in t.scorer.specs]
    failed = {f.index for f in result.failures}
    values = []
    for i, (score, steps) in enumerate(zip(result.scores, result.steps)):
        if process and steps is None and i not in failed:
            raise ValueError(f"algorithm.advantage=process needs step scores, but reward functions {names} "
                             f"returned a float for sample {i}; return grpo_mega.rewards.StepScores from "
                             "them, or use --algorithm.advantage=outcome")
        if not process and steps is not None:
            raise ValueError(f"reward functions {names} returned StepScores for sample {i}, which "
                             "only process supervision uses; set --algorithm.advantage=process")
        values.append((steps or StepScores([], [])) if process else float(score))
    return values


def _scalar(value) -> float:
    """A sample's one number for metrics and evaluation (a StepScores' mean step score)."""
    return value if isinstance(value, float) else value.value


def reward(t: Trainer, prompts: list[Prompt], batch: RolloutBatch) -> tuple[list, dict[str, float]]:
    """Rewards of this replica's samples (floats, or StepScores with process supervision),
    and reward / accuracy / length statistics over the global batch (all replicas)."""
    rewards, failures = _score(t, prompts, batch)
    # Only trained samples count: a group dropped from training (an episode not token-exact,
    # or an error without error_reward; episode_info["dropped"]) would skew the reward
    # statistics; the episode metrics (episodes_dropped among them) count every episode.
    kept = torch.tensor([not (i or {}).get("dropped") for i in batch.episode_info] if batch.episode_info
                        else [True] * len(rewards), dtype=torch.float64)
    r = torch.tensor([_scalar(v) for v in rewards], dtype=torch.float64) * kept
    lens = torch.tensor(batch.response_lengths, dtype=torch.float64) * kept
    truncated = sum(f == "length" and bool(k) for f, k in zip(batch.finish_reasons, kept))
    extra = []
    if t.episodes is not None or t.gateway is not None:
        from grpo_mega.trainer.episodes import EPISODE_KEYS, episode_stats
        extra = episode_stats(batch)
    v = torch.tensor([r.sum(), (r * r).sum(), kept.sum(), ((r >= 1.0) * kept).sum(), lens.sum(), truncated,
                      float(len(rewards)), *extra],
                     dtype=torch.float64, device=t.ps.device)  # NCCL groups take device tensors only
    if t.ps.dp > 1:
        dist.all_reduce(v, group=t.ps.dp_group)
    n = max(float(v[2]), 1.0)
    mean = float(v[0]) / n
    stats = {"reward_mean": mean, "reward_std": math.sqrt(max(float(v[1]) / n - mean * mean, 0.0)),
             "accuracy": float(v[3]) / n, "response_len": float(v[4]) / n,
             "truncated_frac": float(v[5]) / n, "reward_failures": float(failures)}
    if extra:
        every = max(float(v[6]), 1.0)
        stats.update({k: float(x) / every for k, x in zip(EPISODE_KEYS, v[7:].tolist())})
    return rewards, stats


# ----------------------------------------------------------------------- advantage

def advantage(t: Trainer, batch: RolloutBatch | KeptGroups, rewards: list) -> TrainingBatch:
    """Group-normalised advantages (per sequence, or per token from step scores with
    ``algorithm.advantage=process``) and the step's ``TrainingBatch`` on the trainer's device."""
    algo = t.cfg.algorithm
    if algo.advantage == "process":
        adv = _process_advantages(t, batch, rewards)
    else:
        adv = A.group_advantages(torch.tensor(rewards), t.cfg.rollout.n, norm=algo.norm, baseline=algo.baseline)
    return TrainingBatch.pack(batch.prompt_ids, batch.response_ids, batch.logprobs, adv, pad_id=t.pad_id,
                              device=t.ps.device, pad_to_multiple=seq_multiple(t.cfg.model, t.ps.tp),
                              response_mask=batch.response_mask, packing=t.cfg.parallel.packing)


def record(t: Trainer, step: int, batch: TrainingBatch) -> None:
    """``logging.record_batches``: this replica's batch to ``run_dir/batches``, written by
    its first rank (every rank of a replica holds the same batch)."""
    if t.ps.tp_rank == 0 and t.ps.pp_rank == 0:
        out = Path(t.cfg.logging.run_dir) / "batches"
        out.mkdir(parents=True, exist_ok=True)
        batch.save(out / f"step{step:06d}_dp{t.ps.dp_rank}.pt")


def _process_advantages(t: Trainer, batch: RolloutBatch, steps: list) -> torch.Tensor:
    """[N, longest response] per-token advantages from each sample's StepScores."""
    from grpo_mega.trainer.steps import process_token_advantages, token_step_ends

    ends = [token_step_ends(s.ends, ids, t.tokenizer.decode) for s, ids in zip(steps, batch.response_ids)]
    width = max([len(ids) for ids in batch.response_ids] + [1])
    return process_token_advantages([s.scores for s in steps], ends, t.cfg.rollout.n, width)


# ------------------------------------------------------------------------ logprobs

@dataclass
class UpdatePlan:
    """The mini-batches of one step, each split into micro-batches (all views of one batch)."""

    minis: list[list[TrainingBatch]]
    off_policy: bool
    """The proximal (old-policy) log-probs were computed into the batch; else the update
    takes its own log-probs, detached, as the proximal ones."""
    replay_routing: bool = False
    """The update forwards replay the MoE routing recorded in the micro-batches."""
    batch: Optional[TrainingBatch] = None
    """The batch the micro-batches are views of: the step's, or under a token budget a copy
    with its rows reordered (``trainer.microbatches``); ``order[i]``: the step's row at row i."""
    order: Optional[list[int]] = None

    @property
    def flat(self) -> list[TrainingBatch]:
        return [mb for ms in self.minis for mb in ms]


def _kernel_kw(t: Trainer) -> dict:
    return dict(vocab_size=t.cfg.model.vocab_size, temperature=t.temperature,
                fused=use_fused(t.cfg.algorithm.logprob_kernel, t.ps.device),
                chunk_size=t.cfg.algorithm.logits_chunk_size or None)


def _exact_kl(t: Trainer) -> bool:
    """The KL kind needs the reference's logits (``full``): the reference then runs inside
    the update, micro-batch by micro-batch, instead of as a log-prob pass here."""
    return t.ref is not None and A.kl_needs_logits(t.cfg.algorithm.kl_kind)


@contextlib.contextmanager
def _reference_on_device(t: Trainer) -> Iterator[None]:
    """With ``checkpoint.offload_reference`` the frozen copy stays off the GPU between uses."""
    offload = t.cfg.checkpoint.offload_reference
    if offload:
        models.offload(t.ref, t.ps.device)
    try:
        yield
    finally:
        if offload:
            models.offload(t.ref, torch.device("cpu"))


def logprobs(t: Trainer, batch: TrainingBatch) -> UpdatePlan:
    """Reference (KL) and, when the off-policy objective needs them, proximal (old-policy)
    log-probs, written into ``batch`` (``A.proximal_pass_needed``). With ``decoupled``, one
    PPO epoch, one mini-batch, no TIS and ``max_staleness: 0`` they equal the current ones
    at update time, so that forward is skipped; with ``max_staleness >= 1`` it always runs
    (the current weights are no longer the behaviour policy); ``behaviour`` never needs it
    (it clips against the rollout's log-probs). With ``kl_kind: full``
    the reference runs inside the update instead (see ``update``). With
    ``algorithm.routing_replay: record-in-trainer`` the old-policy pass also records the
    policy's MoE routing into ``batch.routed_experts`` for the update to replay."""
    cfg, ps, algo = t.cfg, t.ps, t.cfg.algorithm
    per_rank_mini = (cfg.data.mini_batch_size or cfg.data.prompts_per_step * cfg.rollout.n) // ps.dp
    off_policy = A.proximal_pass_needed(algo.off_policy, ppo_epochs=algo.ppo_epochs,
                                        mini_batches=-(-len(batch) // per_rank_mini),
                                        max_staleness=algo.max_staleness, tis_cap=algo.tis_cap)
    ref_logprobs = t.ref is not None and not _exact_kl(t)
    record = off_policy and algo.routing_replay == "record-in-trainer"
    # A row count or a token budget (rows reordered within each mini-batch, count agreed over DP).
    batch, sizes, order = plan_micro_batches(batch, per_rank_mini, cfg.parallel.micro_batch_size,
                                         cfg.parallel.max_tokens_per_micro_batch,
                                         ps.dp_group if ps.dp > 1 else None, ps.device)
    if ref_logprobs:
        batch.ref_logp = batch.empty_logp()
    if off_policy:
        batch.old_logp = batch.empty_logp()
    if record:
        batch.routed_experts = batch.empty_routing(cfg.model.num_layers, cfg.model.moe_router_topk)
    # Slice after allocating, so the micro-batch views alias the buffers filled below.
    plan = UpdatePlan(cut(batch, sizes), off_policy, replay_routing=record, batch=batch, order=order)
    kw = _kernel_kw(t)
    if ref_logprobs:
        with _reference_on_device(t):
            compute_logprobs(t.ref, plan.flat, ps, key="ref_logp", **kw)
    if off_policy:
        compute_logprobs(t.model, plan.flat, ps, key="old_logp", record_routing=record, **kw)
    return plan


# -------------------------------------------------------------------------- update

def update(t: Trainer, plan: UpdatePlan) -> dict[str, float]:
    """ppo_epochs x mini-batches of clipped surrogate + KL, one optimizer step each; the
    last step's metrics, as floats (the step's one host sync of the metrics). With
    ``kl_kind: full`` the reference runs next to the policy on every micro-batch. Routing
    recorded by ``logprobs`` is replayed in every update forward."""
    metrics: dict = {}
    exact = _exact_kl(t)
    with _reference_on_device(t) if exact else contextlib.nullcontext():
        for _ in range(t.cfg.algorithm.ppo_epochs):
            for micro in plan.minis:
                metrics = update_policy(t.model, t.optimizer, micro, t.ps, t.cfg.algorithm,
                                        max_len=t.cfg.rollout.max_new_tokens,
                                        reuse_current_as_old=not plan.off_policy,
                                        reference=t.ref if exact else None, replay_routing=plan.replay_routing,
                                        **_kernel_kw(t))
                if not metrics["skipped"]:  # a step skipped for a non-finite gradient norm
                    t.scheduler.step()      # must not move the learning-rate schedule either
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

def release_engine(t: Trainer) -> None:
    """The training phase starts: the engine discards its weights and KV cache (vLLM sleep
    level 2 on GPU when ``rollout.sleep_between_rollouts``; a recorded no-op on CPU)."""
    t.engine.release()


def resume_engine(t: Trainer) -> None:
    """The training phase is over: torch's CUDA cache is emptied, then the engine maps its
    weights' memory back (the KV cache waits until after the sync, see ``sync``)."""
    t.engine.wake_weights()


def sync(t: Trainer) -> float:
    """Trainer weights -> engine in place (verified when configured), then the engine's KV
    cache wakes; returns GB/s. The engine stays awake after it, for evaluation and the next
    step's rollouts."""
    if t.cfg.rollout.placement == "separate":
        t.engine.next_version = t.step  # the engines' tokens from now on: policy version = step
    gbps = t.bridge.sync().gbps
    t.engine.wake_kv_cache()
    return gbps


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


def bar_metrics(m: dict) -> dict[str, str]:
    """The few step metrics shown on the run's progress bar."""
    out = {k: f"{m[key]:.3f}" for key, k in (("reward_mean", "reward"), ("kl", "kl")) if key in m}
    secs = sum(v for k, v in m.items() if k.startswith("time/"))
    if secs:
        out["s/step"] = f"{secs:.2f}"
    if "eval_accuracy" in m:
        out["eval"] = f"{m['eval_accuracy']:.1%}"
    return out


# ------------------------------------------------------------------------ evaluate

def evaluate(t: Trainer, step: int) -> float:
    """Held-out accuracy: greedy (eval_samples=1) or pass@k at the rollout temperature."""
    from grpo_mega.rollout import SamplingConfig

    k = t.cfg.data.eval_samples
    prompts = list(t.eval_set.prompts)
    split = math.lcm(t.ps.dp, t.engine.dp_size)  # over the trainer's and the engines' replicas
    prompts = prompts[:len(prompts) - len(prompts) % split]
    s = SamplingConfig(n=k, temperature=0.0 if k == 1 else t.cfg.rollout.temperature,
                       max_new_tokens=t.cfg.rollout.max_new_tokens, stop=tuple(t.cfg.rollout.stop),
                       seed=t.cfg.rollout.seed + 7919)
    batch = _generate(t, prompts, step, s, progress=t.cfg.logging.progress and t.ps.rank == 0)
    rewards, _ = _score(t, prompts, batch)
    solved: dict[int, bool] = {}
    for i, r in enumerate(rewards):
        solved[batch.prompt_index[i]] = solved.get(batch.prompt_index[i], False) or _scalar(r) >= 1.0
    v = torch.tensor([float(sum(solved.values())), float(len(solved))], dtype=torch.float64,
                     device=t.ps.device)  # NCCL groups take device tensors only
    if t.ps.dp > 1:
        dist.all_reduce(v, group=t.ps.dp_group)
    return float(v[0] / max(float(v[1]), 1.0))


# ---------------------------------------------------------------------- checkpoint

def checkpoint(t: Trainer) -> None:
    """Model, optimizer, data position, scheduler and eval results, resumable at any layout;
    the reference too once a reset has made it differ from the initial weights."""
    from grpo_mega.checkpoint import save_checkpoint

    # Asynchronous GRPO: the position before the oldest batch still in flight, so a resumed
    # run draws (and samples anew) every prompt not yet trained on: none skipped, none twice.
    data = t.pipeline.data_state(t) if t.pipeline is not None else t.dataset.state_dict()
    common = {"model": dataclasses.asdict(t.cfg.model), "data": data,
              "scheduler": t.scheduler.state_dict(), "eval_initial": t.eval_initial,
              "eval_last": t.eval_last, "ref_reset_step": t.ref_reset_step}
    reference = t.ref if t.ref_reset_step is not None else None
    path = save_checkpoint(t.ckpt_dir, t.step, t.model, t.optimizer, t.ps,
                           json.loads(json.dumps(common, default=str)), keep_last=t.cfg.checkpoint.keep_last,
                           reference=reference)
    t.say(f"checkpoint saved: {path}")


def export_hf(t: Trainer, periodic: bool = False) -> None:
    """The current weights as a Hugging Face directory in ``<run_dir>/hf`` (collective):
    after the last step unless ``checkpoint.export_hf`` is ``never``, and after every
    periodic save (``periodic``) when it is ``checkpoints``."""
    from grpo_mega.bridge import export_hf_weights
    from grpo_mega.checkpoint.export_hf import write_hf_dir

    mode = t.cfg.checkpoint.export_hf
    if mode == "never" or (periodic and mode != "checkpoints"):
        return
    out = write_hf_dir(export_hf_weights(t.model, t.cfg.model, t.ps), Path(t.cfg.logging.run_dir) / "hf",
                       t.cfg.model.hf_checkpoint, t.cfg.model, step=t.step, progress=None)
    t.say(f"model exported for transformers and vLLM: {out} (step {t.step})")
