"""ZeRO-1 AdamW: Adam moments and fp32 master weights sharded over the DP group.

``optimizer.use_distributed_optimizer: true`` selects it (``build_optimizer``). The
layout follows megatron's DistributedOptimizer, whose own DDP wrapper and optimizer
allocate on CUDA (PLATFORM_NOTES), so this one is plain torch and runs on gloo too:

* the model's trainable parameters become views into one flat buffer per dtype
  (``_Bucket.param_buf``; a bf16 model keeps a few fp32 parameters), padded to a
  multiple of dp; DP rank ``r`` owns the contiguous slice ``[r * shard, (r + 1) * shard)``
  of each;
* each micro-batch's gradient is added into a flat fp32 buffer (``grad_buf``) by a
  post-accumulate-grad hook (megatron's main grads), so bf16 micro-batch sums do not
  round;
* ``reduce_grads``: tied-embedding grads are summed over the embedding group, and the
  grads each TP rank holds only part of (QK-norms; norms under sequence parallelism) over
  TP, on the full buffer (the two stages' flat layouts differ, so it cannot wait for the slices),
  then ``reduce_scatter_tensor`` over DP leaves each rank the DP-sum of its slice;
* the clip norm sums squares over the owned slice (each parameter counted once, as in
  ``global_grad_norm``), then over DP and over the model-parallel group;
* AdamW updates the fp32 master slice (the only fp32 copy of the weights, also for
  fp32 models), which is cast to the model dtype and ``all_gather_into_tensor``-ed into
  ``param_buf``, i.e. into every parameter at once.

Per rank: the fp32 grad buffers (4 B/param) and the weights are whole; m, v and the
master are 12 B/param / dp (+ < dp elements of padding per bucket); the reduced slice
(``master.grad``, 4 B/param / dp) lives from the reduce-scatter to the end of ``step``
and is freed there, so it does not sit next to the engine between steps.
Checkpoints stay layout-independent: ``full_state()`` gathers the slices into whole
per-parameter tensors (the layout ``ParallelAdamW`` keeps) in host memory, chunk by chunk
(``gather_chunk_bytes`` of accelerator memory at a time, through a pinned staging buffer
on GPU), for the duration of a save or load, so a checkpoint saved at DP=2 resumes at DP=1
with either optimizer, and back, and a save needs no 12 B/param of free accelerator memory.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from grpo_mega.config import OptimizerConfig
from grpo_mega.distributed.state import ParallelState
from grpo_mega.runtime.faults import fault_point
from grpo_mega.optim.adamw import clip_coefficient, counts_once, is_tp_partial_grad

_MOMENTS = ("exp_avg", "exp_avg_sq")
GATHER_CHUNK_BYTES = 256 << 20
"""Accelerator memory one step of ``full_state``'s gather takes by default: a chunk of every
DP rank's slice, gathered, before it is copied to host memory."""


def shard_bounds(numel: int, dp: int, dp_rank: int) -> tuple[int, int, int]:
    """(shard size, start, end) of DP rank ``dp_rank``'s slice of a flat buffer of
    ``numel`` elements padded to a multiple of ``dp`` (padding is < dp elements)."""
    shard = -(-numel // dp) if numel else 0
    return shard, dp_rank * shard, (dp_rank + 1) * shard


class _Bucket:
    """The parameters of one dtype as one padded flat buffer, and this rank's slice of it."""

    def __init__(self, params: list, ps: ParallelState, tp_partial: frozenset = frozenset()):
        self.params, self.dtype = params, params[0].dtype
        self.offsets, off = [], 0
        for p in params:
            self.offsets.append(off)
            off += p.numel()
        self.shard, self.lo, self.hi = shard_bounds(off, ps.dp, ps.dp_rank)
        dev = params[0].device
        self.param_buf = torch.zeros(self.shard * ps.dp, dtype=self.dtype, device=dev)
        self.grad_buf = torch.zeros(self.shard * ps.dp, dtype=torch.float32, device=dev)
        with torch.no_grad():
            for p, o in zip(params, self.offsets):
                view = self.param_buf[o:o + p.numel()].view_as(p)
                view.copy_(p)
                p.data = view  # the all-gather after each step writes the weights in place
                p.register_post_accumulate_grad_hook(self._into_grad_buf(o))
        self.master = torch.nn.Parameter(self.param_buf[self.lo:self.hi].float().clone())
        # (start, end) within the owned slice of every parameter that counts in the norm.
        self.norm_spans = []
        for p, o in zip(params, self.offsets):
            a, b = max(o, self.lo), min(o + p.numel(), self.hi)
            if a < b and counts_once(p, ps):
                self.norm_spans.append((a - self.lo, b - self.lo))
        self.embedding = [(o, p.numel()) for p, o in zip(params, self.offsets)
                          if getattr(p, "shared_embedding", False)]
        # TP-replicated weights whose grads are partial per TP rank (``is_tp_partial_grad``).
        self.tp_partial = [(o, p.numel()) for p, o in zip(params, self.offsets) if id(p) in tp_partial]

    def _into_grad_buf(self, offset: int):
        def hook(param):
            self.grad_buf[offset:offset + param.numel()].add_(param.grad.reshape(-1))
            param.grad = None
        return hook

    def reduce(self, ps: ParallelState) -> None:
        """Embedding-group sum on the whole buffer, then DP reduce-scatter into master.grad."""
        if ps.pp > 1:
            for o, n in self.embedding:
                dist.all_reduce(self.grad_buf[o:o + n], group=ps.embedding_group)
        if ps.tp > 1:
            for o, n in self.tp_partial:
                dist.all_reduce(self.grad_buf[o:o + n], group=ps.tp_group)
        if ps.dp > 1:
            # Summed, not averaged: the loss is already normalised by the global token count.
            out = torch.empty(self.shard, dtype=torch.float32, device=self.grad_buf.device)
            dist.reduce_scatter_tensor(out, self.grad_buf, group=ps.dp_group)
        else:
            out = self.grad_buf[self.lo:self.hi].clone()
        self.master.grad = out

    def publish(self, ps: ParallelState) -> None:
        """Master slices -> the model-dtype weights of every DP rank."""
        mine = self.master.detach().to(self.dtype)
        if ps.dp > 1:
            dist.all_gather_into_tensor(self.param_buf, mine, group=ps.dp_group)
        else:
            self.param_buf[self.lo:self.hi].copy_(mine)


class DistributedAdamW:
    """AdamW whose state lives in 1/dp slices; same interface as ``ParallelAdamW``
    (``zero_grad``, ``reduce_grads``, ``step``, ``opt``, ``full_state``, ``state_tensors``,
    ``adam_step``). Build it before the first backward (its hooks collect the grads)."""

    def __init__(self, model, cfg: OptimizerConfig, ps: ParallelState):
        self.ps, self.cfg = ps, cfg
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        partial = frozenset(id(p) for n, p in named if is_tp_partial_grad(n, p))
        by_dtype: dict = {}
        for p in self.params:
            by_dtype.setdefault(p.dtype, []).append(p)
        self.buckets = [_Bucket(ps_, ps, partial) for ps_ in by_dtype.values()]
        # Like ParallelAdamW: a model with any low-precision weight checkpoints fp32 masters.
        self.mixed = any(dt != torch.float32 for dt in by_dtype)
        self._where = {id(p): (b, o) for b in self.buckets for p, o in zip(b.params, b.offsets)}
        self.opt = torch.optim.AdamW([b.master for b in self.buckets], lr=cfg.lr,
                                     betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                     weight_decay=cfg.weight_decay)
        self._full: dict | None = None
        self.gather_chunk_bytes = GATHER_CHUNK_BYTES

    @property
    def param_groups(self):
        return self.opt.param_groups

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds: Adam moments and the fp32 master slices."""
        n = 0
        for b in self.buckets:
            st = self.opt.state[b.master]
            n += sum(t.numel() * t.element_size() for t in [b.master] + [st[k] for k in _MOMENTS if k in st])
        return n

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.grad_buf.zero_()
            b.master.grad = None
        for p in self.params:
            p.grad = None

    def reduce_grads(self) -> None:
        for b in self.buckets:
            b.reduce(self.ps)

    def grad_norm(self) -> float:
        """Global L2 norm of the model's gradients from the owned slices, fp64 sums."""
        ps = self.ps
        sq = torch.zeros((), dtype=torch.float64, device=ps.device)
        for b in self.buckets:
            for lo, hi in b.norm_spans:
                sq += b.master.grad[lo:hi].double().pow(2).sum()
        if ps.dp > 1:
            dist.all_reduce(sq, group=ps.dp_group)
        if ps.world_size > ps.dp:
            dist.all_reduce(sq, group=ps.mp_group)
        return math.sqrt(float(sq))

    def step(self, reduce: bool = True) -> dict:
        """Reduce-scatter (unless already done), clip, update the slices, all-gather.
        Returns {'grad_norm', 'clip_coef', 'skipped'}."""
        if reduce:
            self.reduce_grads()
        if fault_point("update") and self.buckets:
            self.buckets[0].master.grad[0] = float("nan")
        norm = self.grad_norm()
        if not math.isfinite(norm):
            self.zero_grad()
            return {"grad_norm": norm, "clip_coef": 0.0, "skipped": True}
        coef = clip_coefficient(norm, self.cfg.clip_grad)
        if coef != 1.0:
            for b in self.buckets:
                b.master.grad.mul_(coef)
        self.opt.step()
        for b in self.buckets:
            b.publish(self.ps)
            b.master.grad = None  # 4 B/param / dp not held through rollouts and saves
        return {"grad_norm": norm, "clip_coef": coef, "skipped": False}

    def _state(self, b: _Bucket) -> dict:
        st = self.opt.state[b.master]
        if "exp_avg" not in st:
            st["exp_avg"] = torch.zeros_like(b.master)
            st["exp_avg_sq"] = torch.zeros_like(b.master)
            st["step"] = torch.zeros((), dtype=torch.float32)
        return st

    def _slices(self, b: _Bucket) -> dict:
        st = self._state(b)
        out = {k: st[k] for k in _MOMENTS}
        if self.mixed:
            out["main_param"] = b.master.data
        return out

    @contextlib.contextmanager
    def full_state(self, write_back: bool = False):
        """Collective over DP. Inside, ``state_tensors`` returns whole per-parameter tensors
        (gathered from the slices); with ``write_back`` (a checkpoint load), each rank keeps
        its slice of them on exit, and an fp32 model's master is re-read from the (loaded)
        weights. Holds 8-12 B/param of whole state in host memory on every rank while open,
        and ``gather_chunk_bytes`` of accelerator memory at a time while gathering."""
        ps = self.ps
        self._full = {id(b): {k: self._gather_to_host(b, mine) for k, mine in self._slices(b).items()}
                      for b in self.buckets}
        try:
            yield self
            if write_back:
                with torch.no_grad():
                    for b in self.buckets:
                        for k, mine in self._slices(b).items():
                            mine.copy_(self._full[id(b)][k][b.lo:b.hi])
                        if not self.mixed:
                            b.master.data.copy_(b.param_buf[b.lo:b.hi])
                        b.publish(ps)
        finally:
            self._full = None

    def _gather_to_host(self, b: _Bucket, mine: torch.Tensor) -> torch.Tensor:
        """Every DP rank's slice ``mine`` ([shard] fp32 on the job's device) -> one host
        tensor [shard * dp], rank r's slice at [r * shard, (r + 1) * shard). The collective
        runs on the device (NCCL gathers device tensors), one chunk of the slice at a time."""
        ps = self.ps
        host = torch.empty(b.shard * ps.dp, dtype=torch.float32, device="cpu")
        if ps.dp == 1:
            return host.copy_(mine)
        per_rank = host.view(ps.dp, b.shard)
        step = max(self.gather_chunk_bytes // (4 * ps.dp), 1)
        staging = (torch.empty(step * ps.dp, dtype=torch.float32, pin_memory=True)
                   if mine.device.type == "cuda" else None)
        for a in range(0, b.shard, step):
            e = min(a + step, b.shard)
            out = torch.empty((e - a) * ps.dp, dtype=torch.float32, device=mine.device)
            dist.all_gather_into_tensor(out, mine[a:e].contiguous(), group=ps.dp_group)
            if staging is not None:  # one DMA into pinned memory, then a host-to-host copy
                out = staging[:out.numel()].copy_(out)
            per_rank[:, a:e].copy_(out.view(ps.dp, e - a))
        return host

    def state_tensors(self, p: torch.nn.Parameter) -> dict:
        """Whole per-parameter state of model parameter ``p``, shaped like it, as views into
        the buffers ``full_state`` gathered (only valid inside it)."""
        if self._full is None:
            raise RuntimeError("DistributedAdamW.state_tensors is only valid inside full_state()")
        b, o = self._where[id(p)]
        return {k: buf[o:o + p.numel()].view(p.shape) for k, buf in self._full[id(b)].items()}

    @property
    def adam_step(self) -> float:
        return float(self._state(self.buckets[0])["step"]) if self.buckets else 0.0

    @adam_step.setter
    def adam_step(self, value: float) -> None:
        for b in self.buckets:
            self._state(b)["step"] = torch.tensor(float(value))

    def state_dict(self):
        return self.opt.state_dict()

    def load_state_dict(self, sd):
        self.opt.load_state_dict(sd)
