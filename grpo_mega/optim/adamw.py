"""Optimizer with gradient reduction and global-norm clipping across TP/PP/DP.

megatron's DDP wrapper and ``get_megatron_optimizer`` allocate on CUDA and
keep their own state layout, so ``ParallelAdamW`` is used on CPU and GPU (its
DP-sharded sibling is ``optim/distributed.py``):

* gradients are summed over DP (the loss is already normalised by the global
  token count, so a sum is the right reduction, not a mean);
* with PP and tied embeddings, the two embedding copies' grads are summed over
  the embedding group so both stages apply the same update;
* the clip norm counts every parameter exactly once: TP-sharded params are
  summed over TP, TP-replicated ones (norms) count on tp_rank 0 only, the
  last stage's tied-embedding copy is skipped, and stages sum over PP;
* QK-norm weights (Qwen3) are replicated over TP but each rank applies them to its
  own heads only, so each TP rank holds a partial grad: they are summed over TP (as
  megatron's finalize_model_grads does), or the TP replicas would drift apart.

MoE at EP > 1: expert parameters (megatron marks them ``allreduce=False``) are not
replicated over the whole DP group; each EP rank holds other experts, and the
alltoall dispatcher already brought every EP rank's tokens to them. Their grads are
summed over the expert-data-parallel group only (ranks holding the same experts), and
their squares enter the norm over expert TP x EP x PP instead of TP x PP.

Only the reduction groups from ``ParallelState`` are used; nothing global.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from grpo_mega.config import OptimizerConfig
from grpo_mega.runtime.faults import fault_point
from grpo_mega.distributed.state import ParallelState


def counts_once(p: torch.nn.Parameter, ps: ParallelState) -> bool:
    """Whether ``p``'s gradient enters the global norm on this rank (each parameter once)."""
    if getattr(p, "shared", False) and ps.pp > 1:
        return False  # last stage's copy of the tied embedding; stage 0 counts it
    return bool(getattr(p, "tensor_model_parallel", False)) or ps.tp_rank == 0


def is_expert_parallel(p: torch.nn.Parameter) -> bool:
    """An expert weight sharded over EP (megatron sets ``allreduce=False`` when EP > 1)."""
    return not getattr(p, "allreduce", True)


def is_tp_partial_grad(name: str, p: torch.nn.Parameter | None = None) -> bool:
    """A TP-replicated weight whose grad each TP rank sees only part of: the per-head
    q/k RMSNorm, applied to this rank's heads, and under sequence parallelism the norms
    (megatron marks them ``sequence_parallel``), applied to this rank's sequence shard."""
    return (".q_layernorm." in name or ".k_layernorm." in name
            or bool(getattr(p, "sequence_parallel", False)))


def clip_coefficient(norm: float, max_norm: float) -> float:
    """The factor global-norm clipping scales every gradient by (1.0: no clipping, when
    ``max_norm`` <= 0 or the norm is within it)."""
    if max_norm > 0 and norm > max_norm:
        return max_norm / (norm + 1e-6)
    return 1.0


def global_grad_norm(params: list[torch.nn.Parameter], ps: ParallelState) -> float:
    """L2 norm of all gradients of the whole model (all TP shards, all stages, all
    experts), fp64 sums."""
    sq = torch.zeros((), dtype=torch.float64, device=ps.device)
    expert_sq = torch.zeros((), dtype=torch.float64, device=ps.device)
    for p in params:
        if p.grad is not None and counts_once(p, ps):
            (expert_sq if is_expert_parallel(p) else sq).add_(p.grad.detach().double().pow(2).sum())
    if ps.world_size > 1:
        # Sum over the model-parallel group (TP x PP) only: DP replicas hold equal grads.
        dist.all_reduce(sq, group=ps.mp_group)
        if ps.ep > 1:
            # Expert grads: over expert TP x EP x PP, which holds every expert once.
            dist.all_reduce(expert_sq, group=ps.expert_mp_group)
    return math.sqrt(float(sq + expert_sq))


# Parallel attributes megatron sets on parameters, which the reductions above read.
_PARALLEL_ATTRS = ("shared", "shared_embedding", "tensor_model_parallel", "partition_dim",
                   "partition_stride", "sequence_parallel", "allreduce")


class ParallelAdamW:
    """AdamW over this rank's parameters with the reductions above.

    Low-precision (bf16) parameters get megatron's mixed-precision recipe: an
    fp32 master copy that AdamW updates, and fp32 main gradients that each
    micro-batch's bf16 gradient is added into as soon as it is accumulated
    (a post-accumulate-grad hook), so neither the update nor the sum over
    micro-batches rounds in bf16's 8-bit mantissa. The bf16 weights are a
    rounded copy of the master after every step. fp32 parameters are their own
    masters and nothing is copied.
    """

    def __init__(self, model, cfg: OptimizerConfig, ps: ParallelState):
        self.ps, self.cfg = ps, cfg
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.mixed = any(p.dtype != torch.float32 for p in self.params)
        self.main = [self._master_of(p) for p in self.params] if self.mixed else self.params
        self.tp_partial = [m for (n, p), m in zip(named, self.main) if is_tp_partial_grad(n, p)]
        self.opt = torch.optim.AdamW(self.main, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                     eps=cfg.eps, weight_decay=cfg.weight_decay)
        self.embedding_params = [p for p in self.main if getattr(p, "shared_embedding", False)]
        self._master = dict(zip(map(id, self.params), self.main))

    @staticmethod
    def _master_of(p: torch.nn.Parameter) -> torch.nn.Parameter:
        master = torch.nn.Parameter(p.detach().float().clone())
        for attr in _PARALLEL_ATTRS:
            if hasattr(p, attr):
                setattr(master, attr, getattr(p, attr))

        def into_main_grad(param):
            if master.grad is None:
                master.grad = param.grad.float()
            else:
                master.grad.add_(param.grad)
            param.grad = None

        p.register_post_accumulate_grad_hook(into_main_grad)
        return master

    @property
    def param_groups(self):
        return self.opt.param_groups

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        for p in self.main:
            p.grad = None

    def reduce_grads(self) -> None:
        ps = self.ps
        for p in self.main:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        dense = [p for p in self.main if not is_expert_parallel(p)]
        experts = [p for p in self.main if is_expert_parallel(p)]
        for params, group, size in ((dense, ps.dp_group, ps.dp),
                                    (experts, ps.expert_dp_group, ps.dp // ps.ep)):
            if size > 1 and params:
                # One flat buffer: one collective instead of one per tensor.
                flat = torch.cat([p.grad.reshape(-1) for p in params])
                dist.all_reduce(flat, group=group)
                self._unflatten(flat, params)
        if ps.tp > 1 and self.tp_partial:
            flat = torch.cat([p.grad.reshape(-1) for p in self.tp_partial])
            dist.all_reduce(flat, group=ps.tp_group)
            self._unflatten(flat, self.tp_partial)
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
        if fault_point("update") and self.main:
            self.main[0].grad.view(-1)[0] = float("nan")
        norm = global_grad_norm(self.main, self.ps)
        if not math.isfinite(norm):
            self.zero_grad()
            return {"grad_norm": norm, "clip_coef": 0.0, "skipped": True}
        coef = clip_coefficient(norm, self.cfg.clip_grad)
        if coef != 1.0:
            for p in self.main:
                p.grad.mul_(coef)
        self.opt.step()
        if self.mixed:
            with torch.no_grad():
                for p, master in zip(self.params, self.main):
                    p.copy_(master)
        for p in self.main:  # the next micro-batch's hook makes them anew: 4 B/param not held
            p.grad = None    # through rollouts and saves
        return {"grad_norm": norm, "clip_coef": coef, "skipped": False}

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds: Adam moments, plus fp32 masters in bf16."""
        n = sum(t.numel() * t.element_size() for st in self.opt.state.values()
                for k, t in st.items() if k in ("exp_avg", "exp_avg_sq"))
        return n + (sum(m.numel() * m.element_size() for m in self.main) if self.mixed else 0)

    def full_state(self, write_back: bool = False):
        """``state_tensors`` is valid at any time here (the state is whole on every rank);
        the context exists for ``DistributedAdamW``'s sake, which gathers its slices."""
        return contextlib.nullcontext(self)

    def state_tensors(self, p: torch.nn.Parameter) -> dict:
        """The per-parameter tensors a checkpoint must hold for model parameter ``p``, shaped
        like it: Adam's moments, plus the fp32 master weight when training in bf16.
        Before the first step they are created as zeros, so a checkpoint loads into them."""
        master = self._master[id(p)]
        state = self.opt.state[master]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(master)
            state["exp_avg_sq"] = torch.zeros_like(master)
            state["step"] = torch.zeros((), dtype=torch.float32)
        out = {"exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}
        if self.mixed:
            out["main_param"] = master.data
        return out

    @property
    def adam_step(self) -> float:
        for st in self.opt.state.values():
            if "step" in st:
                return float(st["step"])
        return 0.0

    @adam_step.setter
    def adam_step(self, value: float) -> None:
        for st in self.opt.state.values():
            st["step"] = torch.tensor(float(value))

    def state_dict(self):
        return self.opt.state_dict()

    def load_state_dict(self, sd):
        self.opt.load_state_dict(sd)
