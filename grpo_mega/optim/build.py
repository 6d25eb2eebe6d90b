"""Picks the optimizer the config asks for; the trainer's only way to build one."""
from __future__ import annotations

from grpo_mega.config import OptimizerConfig
from grpo_mega.distributed.state import ParallelState
from grpo_mega.optim.adamw import ParallelAdamW
from grpo_mega.optim.distributed import DistributedAdamW


def build_optimizer(model, cfg: OptimizerConfig, ps: ParallelState) -> ParallelAdamW | DistributedAdamW:
    """``DistributedAdamW`` (state sharded over DP) with ``optimizer.use_distributed_optimizer``,
    else ``ParallelAdamW``; both run on CPU and GPU. Build it before the first backward:
    the distributed one collects gradients with hooks."""
    if cfg.use_distributed_optimizer:
        return DistributedAdamW(model, cfg, ps)
    return ParallelAdamW(model, cfg, ps)
