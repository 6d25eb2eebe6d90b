"""Distributed runtime: ``ParallelState`` (torch.distributed plus megatron's TP/PP/DP
groups as one explicit object), the CPU compatibility layer that lets megatron-core run
on a CPU-only torch (applied only when CUDA is absent), and the glue that drives
megatron's pipeline schedules over a list of micro-batches."""
from grpo_mega.distributed.state import ParallelState, destroy_parallel, free_port, init_parallel

__all__ = ["ParallelState", "destroy_parallel", "free_port", "init_parallel"]
