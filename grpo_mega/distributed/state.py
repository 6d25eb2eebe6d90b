"""torch.distributed + megatron model-parallel groups, exposed as one object.

``init_parallel`` is the only place that touches megatron's global parallel
state. Everything downstream receives the returned ``ParallelState`` and passes
its groups explicitly (``ps.tp_group`` to the loss, ``ps.dp_group`` to the
gradient reduction), so the math never reads globals.

Backends: NCCL when CUDA is available, otherwise gloo with one thread per rank
(two threads per rank made TP=2 15x slower on 2 cores).

    ps = init_parallel(tp=2, pp=1, seed=1234)      # under torchrun
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist


@dataclass
class ParallelState:
    """Ranks, sizes and process groups of this process, with named axes."""

    rank: int
    world_size: int
    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: Any
    pp_group: Any
    dp_group: Any
    mp_group: Any
    embedding_group: Any
    device: torch.device
    ep: int = 1
    """Expert-parallel size; the EP group is made of DP ranks (same TP and PP ranks)."""
    ep_rank: int = 0
    ep_group: Any = None
    expert_dp_group: Any = None
    """Ranks holding the same experts (DP / EP of them): expert grads are summed here."""
    expert_mp_group: Any = None
    """Expert TP x EP x PP: together these ranks hold every expert of the model once."""

    def local_experts(self, num_experts: int) -> range:
        """Global indices of the experts this rank holds (megatron: contiguous blocks)."""
        per = num_experts // self.ep
        return range(self.ep_rank * per, (self.ep_rank + 1) * per)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def is_replica_leader(self) -> bool:
        """First rank of this DP replica (tp_rank 0 on pipeline stage 0)."""
        return self.tp_rank == 0 and self.pp_rank == 0

    def stage_layers(self, num_layers: int) -> range:
        """Global indices of the transformer layers this pipeline stage holds."""
        per = num_layers // self.pp
        return range(self.pp_rank * per, (self.pp_rank + 1) * per)

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.world_size} tp {self.tp_rank}/{self.tp} "
                f"pp {self.pp_rank}/{self.pp} dp {self.dp_rank}/{self.dp} ep {self.ep_rank}/{self.ep} "
                f"on {self.device}")


def init_parallel(tp: int = 1, pp: int = 1, *, ep: int = 1, seed: int = 1234,
                  timeout_minutes: float = 10.0, backend: Optional[str] = None) -> ParallelState:
    """Initialise torch.distributed (if needed) and megatron's groups for tp x pp x dp,
    with ``ep`` expert-parallel ranks carved out of each TP/PP position's DP ranks.

    Reads RANK/WORLD_SIZE/MASTER_ADDR from the environment (torchrun sets them);
    without them it starts a single-rank world.
    """
    cuda = torch.cuda.is_available()
    if not cuda:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
        from grpo_mega.distributed import cpu_compat, strict_devices
        cpu_compat.apply()
        # The multi-rank tests hold the CPU job to NCCL's rule: no host tensor in a collective.
        strict_devices.enable_from_env()
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        dist.init_process_group(backend or ("nccl" if cuda else "gloo"),
                                timeout=timedelta(minutes=timeout_minutes))
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"world size {world} is not divisible by tp*pp={tp * pp} "
                         f"(--parallel.tp/--parallel.pp)")
    if (world // (tp * pp)) % ep:
        raise ValueError(f"expert-parallel size ep={ep} does not divide the data-parallel size "
                         f"{world // (tp * pp)} (--parallel.ep)")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))

    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    if not mpu.model_parallel_is_initialized():
        mpu.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
            distributed_timeout_minutes=int(max(timeout_minutes, 1)),
            create_gloo_process_groups=cuda)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return ParallelState(
        rank=dist.get_rank(), world_size=world, tp=tp, pp=pp, dp=world // (tp * pp),
        tp_rank=mpu.get_tensor_model_parallel_rank(),
        pp_rank=mpu.get_pipeline_model_parallel_rank(),
        dp_rank=mpu.get_data_parallel_rank(),
        tp_group=mpu.get_tensor_model_parallel_group(),
        pp_group=mpu.get_pipeline_model_parallel_group(),
        dp_group=mpu.get_data_parallel_group(),
        mp_group=mpu.get_model_parallel_group(),
        embedding_group=mpu.get_embedding_group(check_initialized=False),
        device=torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"),
        ep=ep, ep_rank=mpu.get_expert_model_parallel_rank(),
        ep_group=mpu.get_expert_model_parallel_group(),
        expert_dp_group=mpu.get_expert_data_parallel_group(),
        expert_mp_group=mpu.get_expert_tensor_model_pipeline_parallel_group(),
    )


def destroy_parallel() -> None:
    from megatron.core import parallel_state as mpu
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def free_port() -> int:
    """An unused TCP port on 127.0.0.1 (for single-machine worlds and tests)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
