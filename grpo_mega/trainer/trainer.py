"""The ``Trainer``: everything the GRPO loop holds, built once in ``build_trainer``.

Groups, models, optimizer and scheduler, data, the rollout engine and the weight
bridge, the reward scorer, the metrics sink and the checkpoint position. The
step's work lives in ``trainer/stages.py``; ``train.py`` only sequences it.

Build order matters on CPU: torch.distributed and megatron's groups first, then the
vLLM engine (its external_launcher mode joins the already-initialised world).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from grpo_mega.runtime import console
from grpo_mega.config import Config, ConfigError, cli_config, rollout_tp
from grpo_mega.preflight.shape import model_shape_from_hf
from grpo_mega.preflight.paths import check_paths
from grpo_mega.preflight.validate import check_tokenizer_fits, reward_specs, validate

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

    from grpo_mega.bridge import WeightBridge
    from grpo_mega.data import PromptDataset
    from grpo_mega.data.tokenizer import HFTokenizer, SentencePieceTokenizer
    from grpo_mega.distributed.state import ParallelState
    from grpo_mega.optim import DistributedAdamW, ParallelAdamW
    from grpo_mega.rewards import RewardScorer
    from grpo_mega.rollout import RolloutEngine
    from grpo_mega.trainer.metrics import MetricsSink


@dataclass
class Trainer:
    cfg: Config
    ps: ParallelState
    model: GPTModel
    ref: Optional[GPTModel]
    """Frozen reference policy for the KL term; None when kl_coef is 0."""
    optimizer: ParallelAdamW | DistributedAdamW
    scheduler: torch.optim.lr_scheduler.LambdaLR
    tokenizer: SentencePieceTokenizer | HFTokenizer
    dataset: PromptDataset
    eval_set: PromptDataset
    engine: RolloutEngine
    bridge: WeightBridge
    scorer: Optional[RewardScorer]
    """Only on each replica's leader rank, which scores for the replica."""
    sink: Optional[MetricsSink]
    """Only on the logging rank (global rank 0)."""
    ckpt_dir: Path
    step: int = 0
    ref_reset_step: Optional[int] = None
    """Step at whose end the reference last became the policy (iterative GRPO); None while
    it is still the initial weights. Checkpoints store the reference once it is set."""
    eval_initial: Optional[float] = None
    eval_last: Optional[float] = None
    started: float = field(default_factory=time.time)
    locks: list = field(default_factory=list)
    """The run-directory locks this job holds (global rank 0 only); released by ``close``."""
    episodes: Optional[Any] = None
    """Multi-turn runs (``env.name``): the chat codec, environment factory and limits
    (``trainer.episodes.EpisodeSetup``); None for single-turn prompts."""
    gateway: Optional[Any] = None
    """Gateway mode (``gateway.enabled``): an agent program plays the episodes
    (``trainer.gateway.GatewayRun``; its server and agent on rank 0); None otherwise."""
    pipeline: Optional[Any] = None
    """Asynchronous GRPO (``rollout.placement: separate``): the batches in flight
    (``trainer.pipeline.RolloutPipeline``); None in the colocated, synchronous loop."""

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
            console.write(f"[grpo] {msg}")

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
        for obj in (self.gateway, self.scorer, self.engine):
            try:
                if obj is not None:
                    (getattr(obj, "close", None) or getattr(obj, "shutdown"))()
            except Exception:  # noqa: BLE001 - shutting down; nothing left to protect
                pass
        from grpo_mega.distributed.state import destroy_parallel
        destroy_parallel()
        for lock in self.locks:
            lock.release()


# ---------------------------------------------------------------------------- build

@dataclass
class Preflight:
    """What ``preflight`` checked and loaded, before any process group or engine exists."""
    tokenizer: SentencePieceTokenizer | HFTokenizer
    dataset: PromptDataset
    eval_set: PromptDataset
    ckpt_dir: Path
    resume_from: Optional[Path]
    """The checkpoint ``checkpoint.resume`` finds here, or None: read on every rank so that a
    missing or broken one fails before any process group. The run itself resumes from global
    rank 0's choice, made again under the run-directory lock (``_claim_run``)."""


def preflight(cfg: Config, world: int) -> Preflight:
    """Everything checkable without ranks: config and layout, paths, the tokenizer against
    the model's vocabulary, every prompt of both data files, and the checkpoint to resume.
    Runs on every rank before any process group, model or engine, so a mistake costs
    seconds and names its flag instead of surfacing mid-run on some rank."""
    if not cfg.model.hf_checkpoint:
        raise ConfigError("model.hf_checkpoint is required: the rollout engine loads it "
                          "(--model.hf_checkpoint=DIR)")
    model_shape_from_hf(cfg)
    validate(cfg, world)
    check_paths(cfg, require=True)  # the launcher's pre-check runs the same
    init = cfg.model.init_checkpoint
    if init and not (Path(init) / "metadata.json").is_file():
        raise ConfigError(f"model.init_checkpoint={init!r} is not a megatron-core checkpoint directory "
                          "(no metadata.json); convert one with tools/convert_checkpoint.py hf-to-mcore "
                          "(--model.init_checkpoint)")

    from grpo_mega.data import PromptDataset
    from grpo_mega.data.tokenizer import load_tokenizer
    tok = load_tokenizer(cfg.model.hf_checkpoint)
    check_tokenizer_fits(cfg, tok.vocab_size, {"eos": tok.eos_id, "pad": tok.pad_id, "bos": tok.bos_id},
                         where=cfg.model.hf_checkpoint)
    d = cfg.data
    ds_kw = dict(prompt_field=d.prompt_key, messages_field=d.messages_key,
                 reference_field=d.answer_key,
                 metadata_fields=[d.metadata_key] if d.metadata_key else None,
                 chat_template=d.chat_template, max_prompt_tokens=d.max_prompt_tokens)
    dataset = PromptDataset(d.train_path, tok, seed=d.seed, **ds_kw)
    eval_set = PromptDataset(d.eval_path, tok, shuffle=False, **ds_kw)

    from grpo_mega.checkpoint.trainer_state import resume_checkpoint
    ckpt_dir = Path(cfg.checkpoint.dir or Path(cfg.logging.run_dir) / "checkpoints")
    return Preflight(tok, dataset, eval_set, ckpt_dir, resume_checkpoint(ckpt_dir, cfg.checkpoint.resume))


def _claim_run(cfg: Config, ps: ParallelState, ckpt_dir: Path, say) -> tuple[list, Optional[Path]]:
    """Collective. Global rank 0 takes the run directory's lock and the checkpoint
    directory's (a job whose checkpoint directory lies in another job's run directory
    shared it with that job), then decides the checkpoint to resume from (under
    ``resume=never``, after moving the old steps aside); every rank receives that
    decision. Without the lock two jobs wrote one directory; without
    the broadcast two ranks resumed from different steps (each read ``latest`` while the
    other job was rotating checkpoints). A second live job fails on every rank, naming
    the holder."""
    from grpo_mega.checkpoint import steps
    from grpo_mega.checkpoint.run_lock import RunDirectoryLocked, lock_run
    from grpo_mega.checkpoint.trainer_state import resume_checkpoint

    locks: list = []
    decision: list = [None, None]  # [error message, checkpoint path]
    if ps.rank == 0:
        try:
            locks = lock_run(cfg.logging.run_dir, ckpt_dir)
            for lock in locks:
                if lock.taken_over():
                    say(f"{lock.directory}: {lock.taken_over()}")
            found = resume_checkpoint(ckpt_dir, cfg.checkpoint.resume)
            if cfg.checkpoint.resume == "never":
                moved = steps.set_aside(ckpt_dir)
                if moved is not None:
                    say(f"checkpoint.resume=never: moved the earlier steps of {ckpt_dir} into {moved}")
            decision = [None, None if found is None else str(found)]
        except RunDirectoryLocked as e:
            decision = [str(e), None]
    if ps.world_size > 1:
        dist.broadcast_object_list(decision, src=0)
    if decision[0] is not None:
        for lock in locks:
            lock.release()
        raise RunDirectoryLocked(decision[0])
    return locks, None if decision[1] is None else Path(decision[1])


def build_trainer(argv=None) -> Trainer:
    cfg = cli_config(argv)
    # Again here for callers other than ``python -m grpo_mega.train`` and for a YAML
    # ``verbose``; vLLM reads its level when first imported, which is below.
    console.quiet_third_party(cfg.logging.verbose)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    pre = preflight(cfg, world)
    tok, dataset, eval_set, ckpt_dir = pre.tokenizer, pre.dataset, pre.eval_set, pre.ckpt_dir

    from grpo_mega.distributed.state import init_parallel
    ps = init_parallel(cfg.parallel.tp, cfg.parallel.pp, ep=cfg.parallel.ep, seed=cfg.parallel.seed,
                       timeout_minutes=cfg.parallel.timeout_minutes)
    say = (lambda m: console.write(f"[grpo] {m}")) if ps.rank == 0 else (lambda m: None)
    say(f"world {ps.world_size}: tp {ps.tp} x pp {ps.pp} x dp {ps.dp} on {ps.device}")
    locks, latest = _claim_run(cfg, ps, ckpt_dir, say)  # before anything is built or written
    say(f"data: {len(dataset)} train prompts ({dataset.num_skipped_too_long} skipped as too long), "
        f"{len(eval_set)} eval prompts")

    say("building actor" + (" and reference" if cfg.algorithm.kl_coef > 0 else "") + " models")
    from grpo_mega.checkpoint import convert
    from grpo_mega.models import build_model
    model = build_model(cfg.model, ps)
    lora = cfg.model.lora
    # With LoRA the reference is the actor with its adapters off (lora.ReferenceView), built below.
    ref = build_model(cfg.model, ps, frozen=True) if cfg.algorithm.kl_coef > 0 and lora is None else None
    for m in (model, ref):
        if m is None:
            continue
        if cfg.model.init_checkpoint:
            convert.load_mcore_weights(m, cfg.model.init_checkpoint, ps, cfg.model,
                                       allow_unsafe_load=cfg.checkpoint.allow_unsafe_load,
                                       allow_nonfinite=cfg.checkpoint.allow_nonfinite_weights)
        else:
            convert.load_hf_weights(m, cfg.model.hf_checkpoint, ps, cfg.model)

    if lora is not None:
        from grpo_mega import lora as L
        L.attach_lora(model, lora, ps, seed=cfg.parallel.seed)  # freezes the base it just loaded
        ref = L.ReferenceView(model) if cfg.algorithm.kl_coef > 0 else None
        say(f"LoRA rank {lora.rank} on {', '.join(lora.target_modules)}: "
            f"{L.lora_parameter_count(model):,} trainable parameters on this rank; the reference is the "
            "base (adapters off)")
    if cfg.algorithm.routing_replay != "off":
        from grpo_mega.models.routing import install_router_replay
        install_router_replay(model)  # the policy's routers only: the reference routes itself
    if ref is not None and cfg.checkpoint.offload_reference:
        from grpo_mega.models import offload
        offload(ref, torch.device("cpu"))
    from grpo_mega.optim import build_optimizer
    optimizer = build_optimizer(model, cfg.optimizer, ps)
    warm = max(cfg.optimizer.warmup_steps, 0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer.opt, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)

    from grpo_mega.checkpoint import load_checkpoint
    meta = None
    if latest is not None:
        say(f"resuming from {latest}")
        meta = load_checkpoint(latest, model, optimizer, ps, cfg.model, reference=ref,
                               allow_unsafe_load=cfg.checkpoint.allow_unsafe_load,
                               allow_nonfinite=cfg.checkpoint.allow_nonfinite_weights)
        dataset.load_state_dict(meta["data"])
        scheduler.load_state_dict(meta["scheduler"])

    say("starting the vLLM engine (first start takes 10-30 s on CPU)")
    from grpo_mega.config import rollout_tp
    from grpo_mega.rollout import RolloutEngine, SamplingConfig
    from grpo_mega.rollout.layout import engine_block
    r = cfg.rollout
    engine_cfg = engine_config(cfg)
    sampling = SamplingConfig(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=max(r.top_k, 0),
                              max_new_tokens=r.max_new_tokens, stop=tuple(r.stop), seed=r.seed)
    if r.placement == "separate":
        engine = _separate_engines(cfg, ps, engine_cfg, sampling, version=meta["step"] if meta else 0, say=say)
    else:
        # The engine's own blocks of rollout.tp consecutive ranks, not megatron's replicas:
        # vLLM's external launcher needs consecutive ranks, megatron puts PP outermost.
        block, engine_index, engines = engine_block(rollout_tp(cfg))
        say(f"rollout: {engines} engine replica(s) of {rollout_tp(cfg)} consecutive rank(s)")
        engine = RolloutEngine(engine_cfg, sampling, replica_group=block, dp_rank=engine_index, dp_size=engines)

    from grpo_mega.bridge import WeightBridge
    bridge = WeightBridge(model, cfg.model, ps, engines=[engine], verify=r.verify_sync,
                          bucket_bytes=int(r.sync_bucket_mb * 2**20))
    if meta is not None:
        if r.placement == "separate":
            engine.next_version = meta["step"]  # token versions count optimizer steps
        bridge.sync()  # the engine started from the HF weights; give it the resumed ones

    from grpo_mega.trainer.episodes import build_episodes
    episodes = build_episodes(cfg, tok)
    from grpo_mega.trainer.gateway import build_gateway
    gateway = build_gateway(cfg, tok, ps.rank, say)
    scorer = None
    if ps.is_replica_leader and episodes is None and gateway is None:
        from grpo_mega.rewards import RewardScorer
        rc = cfg.reward
        scorer = RewardScorer(reward_specs(cfg), num_workers=rc.num_workers, timeout_s=rc.timeout_seconds,
                              on_error={"stop": "raise", "zero": "zero"}[rc.on_error], group_size=cfg.rollout.n)

    sink = None
    if ps.rank == 0:
        from grpo_mega.trainer.metrics import open_sink
        sink = open_sink(cfg)
    t = Trainer(cfg=cfg, ps=ps, model=model, ref=ref, optimizer=optimizer, scheduler=scheduler,
                tokenizer=tok, dataset=dataset, eval_set=eval_set, engine=engine, bridge=bridge,
                scorer=scorer, sink=sink, ckpt_dir=ckpt_dir, locks=locks, episodes=episodes, gateway=gateway)
    if meta is not None:
        t.step, t.eval_initial, t.eval_last = meta["step"], meta.get("eval_initial"), meta.get("eval_last")
        t.ref_reset_step = meta.get("ref_reset_step")
    say(f"ready: {cfg.algorithm.steps} steps of {cfg.data.prompts_per_step} prompts x {r.n} samples")
    return t


def engine_config(cfg: Config):
    """The vLLM engine's ``EngineConfig`` from the ``rollout`` section."""
    from grpo_mega.rollout import EngineConfig
    r = cfg.rollout
    lora = cfg.model.lora  # model.lora.sync=adapter: the engine serves base + adapter
    return EngineConfig(model=cfg.model.hf_checkpoint, mode=r.engine_mode, max_model_len=r.max_model_len,
                        gpu_memory_utilization=r.gpu_memory_utilization, colocate=r.sleep_between_rollouts,
                        seed=r.seed, logprobs_mode="processed_logprobs", enforce_eager=r.enforce_eager,
                        model_runner=r.model_runner,
                        lora_rank=lora.rank if lora is not None and lora.sync == "adapter" else 0,
                        extra={} if cfg.logging.verbose else {"use_tqdm_on_load": False})


def _separate_engines(cfg: Config, ps: ParallelState, engine_cfg, sampling, *, version: int, say):
    """``rollout.placement: separate``: ``rollout.engines`` engine processes driven from global
    rank 0 (the other ranks get a stand-in the weight bridge skips). GPU: each engine takes
    ``rollout.tp`` ids of ``rollout.engine_devices``. CPU: each engine is pinned to one core
    the trainer's ranks leave free, when the machine has enough (else the OS places it)."""
    from grpo_mega.rollout.remote import remote_engines

    r, etp = cfg.rollout, rollout_tp(cfg)
    devices: list = []
    if ps.device.type == "cuda":
        local = int(os.environ.get("LOCAL_WORLD_SIZE", ps.world_size))  # the trainer's devices: 0..local-1
        ids = list(r.engine_devices) or list(range(local, local + r.engines * etp))
        if set(ids) & set(range(local)) or max(ids) >= torch.cuda.device_count():
            raise ConfigError(f"rollout.engine_devices={ids}: the engines need devices the trainer's {local} "
                              f"rank(s) on this node do not use, among the {torch.cuda.device_count()} visible "
                              "(--rollout.engine_devices, or fewer trainer ranks per node)")
        devices = [ids[k * etp:(k + 1) * etp] for k in range(r.engines)]
    cores: list = []
    free = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if ps.device.type == "cpu" and len(free) >= ps.world_size + r.engines:
        cores = [[c] for c in free[-r.engines:]]
    say(f"rollout: {r.engines} engine process(es) of {etp} device(s), separate from the trainer"
        + (f" (cores {[c[0] for c in cores]})" if cores else ""))
    return remote_engines(ps.rank, engine_cfg, sampling, engines=r.engines, devices=devices, cores=cores,
                          version=version, timeout_s=cfg.parallel.timeout_minutes * 60)

