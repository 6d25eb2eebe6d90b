"""Optimizer with gradient reduction and global-norm clipping across TP/PP/DP.

On GPU, megatron's DDP wrapper and ``get_megatron_optimizer`` own the grads
(``MegatronOptimizer``; distributed optimizer optional). On CPU they allocate on
CUDA, so ``ParallelAdamW`` is the working equivalent used there:

* gradients are summed over DP (the loss is already normalised by the global
  token count, so a sum is the right reduction, not a mean);
* with PP and tied embeddings, the two embedding copies' grads are summed over
  the embedding group so both stages apply the same update;
* the clip norm counts every parameter exactly once: TP-sharded params are
  summed over TP, TP-replicated ones (norms) count on tp_rank 0 only, the
  last stage's tied-embedding copy is skipped, and stages sum over PP.

Only the reduction groups from ``ParallelState`` are used; nothing global.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from grpo_mega.config import OptimizerConfig
from grpo_mega.parallel import ParallelState


def _counts_once(p: torch.nn.Parameter, ps: ParallelState) -> bool:
    if getattr(p, "shared", False) and ps.pp > 1:
        return False  # last stage's copy of the tied embedding; stage 0 counts it
    return bool(getattr(p, "tensor_model_parallel", False)) or ps.tp_rank == 0


def global_grad_norm(params: list[torch.nn.Parameter], ps: ParallelState) -> float:
    """L2 norm of all gradients of the whole model (all TP shards, all stages), fp64 sums."""
    sq = torch.zeros((), dtype=torch.float64, device=ps.device)
    for p in params:
        if p.grad is not None and _counts_once(p, ps):
            sq += p.grad.detach().double().pow(2).sum()
    if ps.world_size > 1:
        # Sum over the model-parallel group (TP x PP) only: DP replicas hold equal grads.
        dist.all_reduce(sq, group=ps.mp_group)
    return math.sqrt(float(sq))


class ParallelAdamW:
    """AdamW over this rank's parameters with the reductions above."""

    def __init__(self, model, cfg: OptimizerConfig, ps: ParallelState):
        self.ps, self.cfg = ps, cfg
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                     eps=cfg.eps, weight_decay=cfg.weight_decay)
        self.embedding_params = [p for p in self.params if getattr(p, "shared_embedding", False)]

    @property
    def param_groups(self):
        return self.opt.param_groups

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def reduce_grads(self) -> None:
        ps = self.ps
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if ps.dp > 1:
            # One flat buffer: one collective instead of one per tensor.
            flat = torch.cat([p.grad.reshape(-1) for p in self.params])
            dist.all_reduce(flat, group=ps.dp_group)
            self._unflatten(flat, self.params)
        if ps.pp > 1 and self.embedding_params:
            for p in self.embedding_params:
                dist.all_reduce(p.grad, group=ps.embedding_group)

    @staticmethod
    def _unflatten(flat, params):
        off = 0
        for p in params:
            n = p.grad.numel()
            p.grad.copy_(flat[off:off + n].view_as(p.grad))
            off += n

    def step(self, reduce: bool = True) -> dict:
        """Reduce (unless already done), clip and apply.
        Returns {'grad_norm', 'clip_coef', 'skipped'}."""
        if reduce:
            self.reduce_grads()
        norm = global_grad_norm(self.params, self.ps)
        if not math.isfinite(norm):
            self.zero_grad()
            return {"grad_norm": norm, "clip_coef": 0.0, "skipped": True}
        coef = 1.0
        if self.cfg.clip_grad > 0 and norm > self.cfg.clip_grad:
            coef = self.cfg.clip_grad / (norm + 1e-6)
            for p in self.params:
                p.grad.mul_(coef)
        self.opt.step()
        return {"grad_norm": norm, "clip_coef": coef, "skipped": False}

    def state_dict(self):
        return self.opt.state_dict()

    def load_state_dict(self, sd):
        self.opt.load_state_dict(sd)


def build_optimizer(model, cfg: OptimizerConfig, ps: ParallelState):
    """``ParallelAdamW`` on CPU. On GPU the same class is used unless the megatron
    optimizer is asked for (``use_distributed_optimizer``), which needs the model
    wrapped in megatron's DDP; see ``build_megatron_optimizer``."""
    if ps.device.type == "cuda" and cfg.use_distributed_optimizer:
        return build_megatron_optimizer(model, cfg)
    return ParallelAdamW(model, cfg, ps)


def build_megatron_optimizer(model, cfg: OptimizerConfig):
    """megatron's DDP + distributed optimizer (GPU only; CUDA allocations inside)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig as MOptConfig, get_megatron_optimizer

    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=False), module=model)
    opt = get_megatron_optimizer(MOptConfig(
        optimizer="adam", lr=cfg.lr, weight_decay=cfg.weight_decay, adam_beta1=cfg.beta1,
        adam_beta2=cfg.beta2, adam_eps=cfg.eps, clip_grad=cfg.clip_grad,
        use_distributed_optimizer=True, bf16=model.config.bf16), [ddp])
    return opt
