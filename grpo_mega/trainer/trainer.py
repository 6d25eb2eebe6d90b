"""Everything the GRPO loop holds, built once: groups, models, optimizer, engine, bridge,
data, rewards, metrics, checkpoint state. ``train.py`` only sequences the stages.

Build order matters on CPU: torch.distributed and megatron's groups first, then the
vLLM engine (its external_launcher mode joins the already-initialised world).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from grpo_mega.config import Config, ConfigError, cli_config

from grpo_mega.preflight.validate import validate


@contextlib.contextmanager
def stage(name: str, timings: dict):
    """Time a named stage (seconds accumulate under ``timings[name]``)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - start


@dataclass
class Trainer:
    cfg: Config
    ps: Any
    model: Any
    ref: Any
    optimizer: Any
    scheduler: Any
    tokenizer: Any
    dataset: Any
    eval_set: Any
    engine: Any
    bridge: Any
    scorer: Any
    sink: Any
    ckpt_dir: Path
    step: int = 0
    eval_initial: Optional[float] = None
    eval_last: Optional[float] = None
    reward_failures: int = 0
    """Samples whose reward raised or timed out in the last scoring (on_error=zero)."""
    started: float = field(default_factory=time.time)

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_id if self.tokenizer.pad_id is not None else self.tokenizer.eos_id

    @property
    def temperature(self) -> float:
        return self.cfg.rollout.temperature or 1.0

    @property
    def leader_rank(self) -> int:
        """Global rank of this replica's first rank (scores rewards for the replica)."""
        return dist.get_global_rank(self.ps.mp_group, 0) if self.ps.world_size > 1 else 0

    def say(self, msg: str) -> None:
        if self.ps.rank == 0:
            print(f"[grpo] {msg}", flush=True)

    # ------------------------------------------------------------------ rewards
    def score(self, prompts, batch) -> list[float]:
        """Rewards for this replica's samples, scored once on the replica leader."""
        from grpo_mega.rewards import RewardSample

        scores = None
        if self.scorer is not None:
            meta = lambda i: {"response_length": len(batch.response_ids[i]),  # noqa: E731
                              "finish_reason": batch.finish_reasons[i]}
            samples = [RewardSample(prompts[batch.prompt_index[i]].text, batch.texts[i],
                                    prompts[batch.prompt_index[i]].reference,
                                    {**prompts[batch.prompt_index[i]].metadata, **meta(i)})
                       for i in range(len(batch))]
            result = self.scorer.score(samples)
            scores = result.scores
            self.reward_failures = len(result.failures)
        if self.ps.world_size > 1 and self.ps.tp * self.ps.pp > 1:
            box = [scores]
            dist.broadcast_object_list(box, src=self.leader_rank, group=self.ps.mp_group)
            scores = box[0]
        return [float(s) for s in scores]

    def reward_stats(self, rewards: list[float], batch) -> dict:
        """Reward / accuracy / length statistics over the global batch (all replicas)."""
        r = torch.tensor(rewards, dtype=torch.float64)
        lens = torch.tensor(batch.response_lengths, dtype=torch.float64)
        truncated = sum(f == "length" for f in batch.finish_reasons)
        v = torch.tensor([r.sum(), (r * r).sum(), float(len(r)), (r >= 1.0).sum(), lens.sum(), truncated],
                         dtype=torch.float64)
        if self.ps.dp > 1:
            dist.all_reduce(v, group=self.ps.dp_group)
        n = max(float(v[2]), 1.0)
        mean = float(v[0]) / n
        return {"reward_mean": mean, "reward_std": math.sqrt(max(float(v[1]) / n - mean * mean, 0.0)),
                "accuracy": float(v[3]) / n, "response_len": float(v[4]) / n,
                "truncated_frac": float(v[5]) / n,
                "reward_failures": float(self.reward_failures)}

    # ------------------------------------------------------------------ metrics
    def gather_metrics(self, metrics: dict) -> dict:
        """Bring the last stage's (DP rank 0, TP rank 0) update metrics to every rank."""
        if self.ps.world_size == 1:
            return metrics
        src = dist.get_global_rank(self.ps.pp_group, self.ps.pp - 1) if self.ps.pp > 1 else self.ps.rank
        box = [metrics if self.ps.is_last_stage else None]
        if self.ps.pp > 1:
            dist.broadcast_object_list(box, src=src, group=self.ps.pp_group)
        return box[0] or {}

    def log(self, step: int, metrics: dict) -> None:
        if self.sink is not None:
            self.sink.log(step, metrics)

    def finish(self) -> dict:
        summary = {"eval_accuracy_initial": self.eval_initial, "eval_accuracy_final": self.eval_last,
                   "steps": self.step, "wall_seconds": time.time() - self.started,
                   "layout": {"tp": self.ps.tp, "pp": self.ps.pp, "dp": self.ps.dp},
                   "run_dir": self.cfg.logging.run_dir}
        if self.sink is not None:
            hist = [h for h in self.sink.history if "reward_mean" in h]
            if hist:
                k = max(1, len(hist) // 10)
                summary["train_reward_first"] = sum(h["reward_mean"] for h in hist[:k]) / k
                summary["train_reward_last"] = sum(h["reward_mean"] for h in hist[-k:]) / k
            self.sink.finish(summary)
        return summary

    def close(self) -> None:
        for obj in (self.scorer, self.engine):
            try:
                if obj is not None:
                    (getattr(obj, "close", None) or getattr(obj, "shutdown"))()
            except Exception:  # noqa: BLE001 - shutting down; nothing left to protect
                pass
        from grpo_mega.distributed.state import destroy_parallel
        destroy_parallel()


# ---------------------------------------------------------------------- evaluation

def evaluate(t: Trainer, step: int) -> float:
    """Held-out accuracy: greedy (eval_samples=1) or pass@k at the rollout temperature."""
    from grpo_mega.rollout import SamplingConfig

    k = t.cfg.data.eval_samples
    prompts = list(t.eval_set.prompts)
    prompts = prompts[:len(prompts) - len(prompts) % t.ps.dp]
    s = SamplingConfig(n=k, temperature=0.0 if k == 1 else t.cfg.rollout.temperature,
                       max_new_tokens=t.cfg.rollout.max_new_tokens, stop=tuple(t.cfg.rollout.stop),
                       seed=t.cfg.rollout.seed + 7919)
    batch = t.engine.generate_for_replica(prompts, s, step=step)
    rewards = t.score(prompts, batch)
    solved = {}
    for i, r in enumerate(rewards):
        solved[batch.prompt_index[i]] = solved.get(batch.prompt_index[i], False) or r >= 1.0
    v = torch.tensor([float(sum(solved.values())), float(len(solved))], dtype=torch.float64)
    if t.ps.dp > 1:
        dist.all_reduce(v, group=t.ps.dp_group)
    return float(v[0] / max(float(v[1]), 1.0))


# ------------------------------------------------------------------------- checkpoint

def save(t: Trainer) -> None:
    from grpo_mega.checkpoint import save_checkpoint

    common = {"model": dataclasses.asdict(t.cfg.model), "data": t.dataset.state_dict(),
              "scheduler": t.scheduler.state_dict(), "eval_initial": t.eval_initial,
              "eval_last": t.eval_last}
    path = save_checkpoint(t.ckpt_dir, t.step, t.model, t.optimizer, t.ps, json.loads(json.dumps(common, default=str)),
                           keep_last=t.cfg.checkpoint.keep_last)
    t.say(f"checkpoint saved: {path}")


# ---------------------------------------------------------------------------- build

def _model_shape_from_hf(cfg: Config) -> None:
    """Fill the model shape from the HF checkpoint's config.json (the engine's truth)."""
    from grpo_mega.models import hf as mapping
    from grpo_mega.models.hf_config import hf_config_from_model_config, model_config_from_hf

    path = Path(cfg.model.hf_checkpoint)
    if not (path / "config.json").is_file():
        raise ConfigError(f"model.hf_checkpoint={str(path)!r} has no config.json (--model.hf_checkpoint)")
    hf = model_config_from_hf(json.loads((path / "config.json").read_text()))
    for f in ("family", "vocab_size", "hidden_size", "num_layers", "num_attention_heads",
              "num_query_groups", "head_dim", "ffn_hidden_size", "rope_theta", "qkv_bias",
              "tie_embeddings", "norm_eps", "max_position_embeddings"):
        setattr(cfg.model, f, getattr(hf, f))


def build_trainer(argv=None) -> Trainer:
    cfg = cli_config(argv)
    if not cfg.model.hf_checkpoint:
        raise ConfigError("model.hf_checkpoint is required: the rollout engine loads it "
                          "(--model.hf_checkpoint=DIR)")
    _model_shape_from_hf(cfg)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    validate(cfg, world)
    for p, flag in ((cfg.data.train_path, "data.train_path"), (cfg.data.eval_path, "data.eval_path")):
        if not p or not Path(p).exists():
            raise ConfigError(f"{flag}={p!r} does not exist (--{flag})")

    from grpo_mega.distributed.state import init_parallel
    ps = init_parallel(cfg.parallel.tp, cfg.parallel.pp, seed=cfg.parallel.seed,
                       timeout_minutes=cfg.parallel.timeout_minutes)
    say = (lambda m: print(f"[grpo] {m}", flush=True)) if ps.rank == 0 else (lambda m: None)
    say(f"world {ps.world_size}: tp {ps.tp} x pp {ps.pp} x dp {ps.dp} on {ps.device}")

    from grpo_mega.data import PromptDataset
    from grpo_mega.data.tokenizer import load_tokenizer
    tok = load_tokenizer(cfg.model.hf_checkpoint)
    d = cfg.data
    ds_kw = dict(prompt_field=d.prompt_key, reference_field=d.answer_key,
                 metadata_fields=[d.metadata_key] if d.metadata_key else None,
                 chat_template=d.chat_template, max_prompt_tokens=d.max_prompt_tokens)
    dataset = PromptDataset(d.train_path, tok, seed=d.seed, **ds_kw)
    eval_set = PromptDataset(d.eval_path, tok, shuffle=False, **ds_kw)
    say(f"data: {len(dataset)} train prompts ({dataset.num_skipped_too_long} skipped as too long), "
        f"{len(eval_set)} eval prompts")

    say("building actor" + (" and reference" if cfg.algorithm.kl_coef > 0 else "") + " models")
    from grpo_mega.checkpoint import convert
    from grpo_mega.models import build_model
    model = build_model(cfg.model, ps)
    ref = build_model(cfg.model, ps, frozen=True) if cfg.algorithm.kl_coef > 0 else None
    for m in (model, ref):
        if m is None:
            continue
        if cfg.model.init_checkpoint:
            convert.load_mcore_weights(m, cfg.model.init_checkpoint, ps, cfg.model)
        else:
            convert.load_hf_weights(m, cfg.model.hf_checkpoint, ps, cfg.model)

    if ref is not None and cfg.checkpoint.offload_reference:
        from grpo_mega.models import offload
        offload(ref, torch.device("cpu"))
    from grpo_mega.optim.adamw import build_optimizer
    optimizer = build_optimizer(model, cfg.optimizer, ps)
    warm = max(cfg.optimizer.warmup_steps, 0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer.opt, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)

    ckpt_dir = Path(cfg.checkpoint.dir or Path(cfg.logging.run_dir) / "checkpoints")
    from grpo_mega.checkpoint import latest_checkpoint, load_checkpoint
    latest = latest_checkpoint(ckpt_dir)
    meta = None
    if latest is not None:
        say(f"resuming from {latest}")
        meta = load_checkpoint(latest, model, optimizer, ps, cfg.model)
        dataset.load_state_dict(meta["data"])
        scheduler.load_state_dict(meta["scheduler"])

    say("starting the vLLM engine (first start takes 10-30 s on CPU)")
    from grpo_mega.rollout import EngineConfig, RolloutEngine, SamplingConfig
    r = cfg.rollout
    engine = RolloutEngine(
        EngineConfig(model=cfg.model.hf_checkpoint, mode=r.engine_mode, max_model_len=r.max_model_len,
                     gpu_memory_utilization=r.gpu_memory_utilization, colocate=r.sleep_between_rollouts,
                     seed=r.seed, logprobs_mode="processed_logprobs"),
        SamplingConfig(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=max(r.top_k, 0),
                       max_new_tokens=r.max_new_tokens, stop=tuple(r.stop), seed=r.seed),
        replica_group=ps.mp_group if ps.world_size > 1 else None, dp_rank=ps.dp_rank, dp_size=ps.dp)

    from grpo_mega.bridge import WeightBridge
    bridge = WeightBridge(model, cfg.model, ps, engines=[engine], verify=r.verify_sync,
                          bucket_bytes=int(r.sync_bucket_mb * 2**20))
    if meta is not None:
        bridge.sync()  # the engine started from the HF weights; give it the resumed ones

    scorer = None
    if ps.is_replica_leader:
        from grpo_mega.rewards import RewardScorer
        rc = cfg.reward
        specs = [{"name": n, "weight": (rc.weights[i] if i < len(rc.weights) else 1.0)}
                 for i, n in enumerate(rc.functions)]
        scorer = RewardScorer(specs, num_workers=rc.num_workers, timeout_s=rc.timeout_seconds,
                              on_error={"stop": "raise", "zero": "zero"}[rc.on_error])

    sink = None
    if ps.rank == 0:
        from grpo_mega.config import to_dict
        from grpo_mega.trainer.metrics import MetricsSink
        Path(cfg.logging.run_dir).mkdir(parents=True, exist_ok=True)
        (Path(cfg.logging.run_dir) / "config.json").write_text(json.dumps(to_dict(cfg), indent=1))
        sink = MetricsSink(cfg.logging.run_dir, tensorboard=cfg.logging.tensorboard,
                           wandb=cfg.logging.wandb, total_steps=cfg.algorithm.steps, config=to_dict(cfg))
    t = Trainer(cfg=cfg, ps=ps, model=model, ref=ref, optimizer=optimizer, scheduler=scheduler,
                tokenizer=tok, dataset=dataset, eval_set=eval_set, engine=engine, bridge=bridge,
                scorer=scorer, sink=sink, ckpt_dir=ckpt_dir)
    if meta is not None:
        t.step, t.eval_initial, t.eval_last = meta["step"], meta.get("eval_initial"), meta.get("eval_last")
    say(f"ready: {cfg.algorithm.steps} steps of {cfg.data.prompts_per_step} prompts x {r.n} samples")
    return t
