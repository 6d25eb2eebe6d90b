"""Picks the optimizer the config asks for; the trainer's only way to build one."""
from __future__ import annotations

from grpo_mega.config import OptimizerConfig
from grpo_mega.distributed.state import ParallelState
from grpo_mega.optim.adamw import ParallelAdamW
from grpo_mega.optim.distributed import DistributedAdamW

DISTRIBUTED_IMPLS = ("grpo", "megatron")
"""``optimizer.distributed_impl`` values: the project's ZeRO-1 optimizer, or megatron-core's
DDP + DistributedOptimizer (``optim/megatron.py``, CUDA only)."""


def build_optimizer(model, cfg: OptimizerConfig, ps: ParallelState):
    """``DistributedAdamW`` (state sharded over DP) with ``optimizer.use_distributed_optimizer``,
    or megatron's DDP + DistributedOptimizer (``MegatronDistributedAdamW``, GPU only) when
    ``optimizer.distributed_impl=megatron``, else ``ParallelAdamW``; all have the same
    interface. Build it before the first backward: the distributed ones collect gradients
    with hooks."""
    if cfg.use_distributed_optimizer and cfg.distributed_impl == "megatron":
        from grpo_mega.optim.megatron import MegatronDistributedAdamW
        return MegatronDistributedAdamW(model, cfg, ps)
    if cfg.use_distributed_optimizer:
        return DistributedAdamW(model, cfg, ps)
    return ParallelAdamW(model, cfg, ps)
