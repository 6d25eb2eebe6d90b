"""Optimizer: AdamW over a TP x PP x DP model with the DP and embedding-group gradient
reductions, a global-norm clip that counts each parameter once, and fp32 master weights
for bf16 training; ``DistributedAdamW`` shards the Adam state and masters over DP (ZeRO-1)."""
from grpo_mega.optim.adamw import ParallelAdamW, global_grad_norm
from grpo_mega.optim.build import build_optimizer
from grpo_mega.optim.distributed import DistributedAdamW

__all__ = ["DistributedAdamW", "ParallelAdamW", "build_optimizer", "global_grad_norm"]
