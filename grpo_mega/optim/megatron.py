"""megatron-core's own ZeRO-1 (``DistributedDataParallel`` + ``DistributedOptimizer``) behind
the interface of ``ParallelAdamW`` / ``DistributedAdamW``: the GPU path users already trust.

Selected by ``optimizer.use_distributed_optimizer: true`` with
``optimizer.distributed_impl: megatron``. megatron's DDP buffers and optimizer allocate on
CUDA and its bf16/clip code asserts CUDA tensors (PLATFORM_NOTES), so training runs it on
GPUs only; preflight refuses it without CUDA. Tests run it on CPU at DP=2 over gloo after
``cpu_compat.enable_megatron_optimizer()``, which moves those CUDA-named allocations to the CPU
(tests/unit/optim/test_megatron_optimizer.py).

* The model chunk is wrapped in megatron's ``DistributedDataParallel`` (``self.ddp``): the
  parameters become views into its padded per-dtype buffers, and its backward hooks add
  each micro-batch's gradient into an fp32 ``main_grad`` buffer. The trainer keeps running
  the unwrapped model; the hooks live on the parameters' grad accumulators, so they fire
  all the same. ``overlap_grad_reduce=False``: nothing communicates during backward, so the
  schedule needs no ``no_sync``.
* The model config has ``calculate_per_token_loss=True`` (``models/gpt.py``), so DDP sums
  over DP instead of averaging: the loss is already normalised by the global token count.
* ``reduce_grads`` is megatron's ``finalize_model_grads`` (DP reduce-scatter, then the
  tied-embedding sum over the embedding group, on the separate bucket DDP gives it).
* ``step`` is ``DistributedOptimizer.step`` taken apart (``prepare_grads``,
  ``get_grad_norm``, ``clip_grad_by_total_norm_fp32``, ``step_with_ready_grads``) so that a
  non-finite norm skips the update, as the other optimizers do: without a loss scaler
  (bf16 / fp32) megatron's own ``step`` would apply it.
* Checkpoints stay layout-independent: ``full_state`` gathers megatron's per-bucket slices
  with ``get_parameter_state_dp_zero(return_on_all_ranks=True)`` and ``state_tensors``
  returns whole per-parameter views of them; a load writes back with
  ``load_parameter_state_from_dp_zero``.
"""
from __future__ import annotations

import contextlib
import math

import torch

from grpo_mega.config import OptimizerConfig
from grpo_mega.distributed import cpu_compat
from grpo_mega.distributed.state import ParallelState
from grpo_mega.runtime.faults import fault_point

_MOMENTS = ("exp_avg", "exp_avg_sq")


class MegatronDistributedAdamW:
    """megatron-core DDP + DistributedOptimizer with the project's optimizer interface.
    Build it before the first backward (DDP's hooks collect the grads)."""

    def __init__(self, model, cfg: OptimizerConfig, ps: ParallelState):
        if not torch.cuda.is_available() and not cpu_compat.megatron_optimizer_on_cpu():
            raise RuntimeError("optimizer.distributed_impl=megatron needs a CUDA GPU; use "
                               "--optimizer.distributed_impl=grpo")
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig as McoreOptimizerConfig
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core.optimizer.optimizer_config import ParamKey, ParamPredicate

        self.ps, self.cfg = ps, cfg
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.mixed = any(p.dtype != torch.float32 for p in self.params)
        ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                overlap_param_gather=False, use_distributed_optimizer=True)
        if not model.config.calculate_per_token_loss:
            # Otherwise DDP averages over DP, and our globally normalised loss needs a sum.
            raise ValueError("MegatronDistributedAdamW needs the model's TransformerConfig to set "
                             "calculate_per_token_loss=True (grpo_mega.models.build_model does)")
        self.ddp = DistributedDataParallel(model.config, ddp_cfg, model)
        mcfg = McoreOptimizerConfig(
            optimizer="adam", lr=cfg.lr, min_lr=0.0, weight_decay=cfg.weight_decay,
            adam_beta1=cfg.beta1, adam_beta2=cfg.beta2, adam_eps=cfg.eps, clip_grad=cfg.clip_grad,
            bf16=self.mixed, params_dtype=self.params[0].dtype, use_distributed_optimizer=True)
        # One param group (plus one for fp32 parameters, below), decayed with
        # optimizer.weight_decay like ParallelAdamW: megatron's default overrides would split
        # off biases and norms with wd_mult=0, which only its own OptimizerParamScheduler
        # applies (the trainer uses a LambdaLR on ``opt``). In a bf16 model the fp32 parameters
        # get a group of their own with the same settings: DistributedOptimizer lists a group's
        # fp32 slices before its bf16 ones, but model_param_group_index_map counts them in
        # buffer order, so in a mixed group its per-parameter state lookup (which the
        # checkpoint gather uses) picks the wrong slice (megatron-core 0.16.1).
        overrides = {}
        if self.mixed:
            fp32 = ParamPredicate(name="fp32", fn=lambda p: p.dtype == torch.float32)
            overrides[ParamKey(predicate=fp32)] = {"wd_mult": 1.0}
        chained = get_megatron_optimizer(mcfg, [self.ddp], config_overrides=overrides)
        if len(chained.chained_optimizers) != 1:
            raise RuntimeError("optimizer.distributed_impl=megatron supports dense models only "
                               f"(got {len(chained.chained_optimizers)} optimizers)")
        self.dopt = chained.chained_optimizers[0]
        self.opt = self.dopt.optimizer  # the inner Adam, over this rank's fp32 slices
        self._spans = self._world_spans()
        self._full: dict | None = None

    @property
    def param_groups(self):
        return self.opt.param_groups

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds: Adam moments, plus the fp32 master slices of
        low-precision parameters (an fp32 parameter's slice is a view of its weights)."""
        n = sum(t.numel() * t.element_size() for st in self.opt.state.values()
                for k, t in st.items() if k in _MOMENTS)
        return n + sum(m.numel() * m.element_size() for g in self.dopt.shard_fp32_from_float16_groups
                       for m in g if m is not None)

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        self.dopt.zero_grad()

    def reduce_grads(self) -> None:
        from megatron.core.distributed import finalize_model_grads
        finalize_model_grads([self.ddp])

    def step(self, reduce: bool = True) -> dict:
        """Reduce (unless already done), clip, update the slices, all-gather the weights.
        Returns {'grad_norm', 'clip_coef', 'skipped'}."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        if reduce:
            self.reduce_grads()
        found_inf = self.dopt.prepare_grads()  # main_grad slices -> the fp32 masters' .grad
        mains = self.dopt.get_parameters()
        if fault_point("update") and mains:
            mains[0].grad.view(-1)[0] = float("nan")
        norm = float(self.dopt.get_grad_norm())
        if found_inf or not math.isfinite(norm):
            self.zero_grad()
            return {"grad_norm": norm, "clip_coef": 0.0, "skipped": True}
        coef = 1.0
        if self.cfg.clip_grad > 0:
            clip_grad_by_total_norm_fp32(mains, self.cfg.clip_grad, norm)
            coef = min(1.0, self.cfg.clip_grad / (norm + 1e-6))  # megatron's clip coefficient
        self.dopt.step_with_ready_grads()
        return {"grad_norm": norm, "clip_coef": coef, "skipped": False}

    def _torch_adam(self) -> bool:
        """torch's Adam keeps ``step`` per parameter; TE/apex FusedAdam per param group."""
        return type(self.opt).__module__.startswith("torch.optim")

    def _ensure_state(self) -> None:
        """Zero moments (and step) for slices that have not stepped yet, so a load has targets."""
        self.dopt.init_state_fn(self.opt, self.dopt.config)
        if self._torch_adam():
            for group in self.opt.param_groups:
                for p in group["params"]:
                    self.opt.state[p].setdefault("step", torch.zeros((), dtype=torch.float32))

    def _world_spans(self) -> dict:
        """Parameter -> (buffer index, dtype key, offset) in ``get_parameter_state_dp_zero``'s
        world tensors, which concatenate each bucket's unpadded elements. From the DDP buffers,
        not ``model_param_gbuf_map``: that one lists only the parameters this rank owns a
        piece of."""
        spans = {}
        for g, buf in enumerate(self.dopt.buffers):
            (key,) = self.dopt.gbuf_ranges[g].keys()
            for p, (start, _, k) in buf.param_index_map.items():
                before = sum(b.numel_unpadded for b in buf.buckets[:k])
                spans[p] = (g, key, before + start - buf.buckets[k].offset)
        return spans

    @contextlib.contextmanager
    def full_state(self, write_back: bool = False):
        """Collective over DP (gloo DP group, CPU tensors). Inside, ``state_tensors`` returns
        whole per-parameter tensors; with ``write_back`` (a checkpoint load) each rank takes
        its slices of them on exit, and an fp32 model's masters are re-read from the (loaded)
        weights. Holds 12 B/param of whole state in host memory on every rank while open."""
        self._ensure_state()
        self._full = self.dopt.get_parameter_state_dp_zero(use_gloo_comm=True, return_on_all_ranks=True)
        try:
            yield self
            if write_back:
                with torch.no_grad():  # the fp32 masters are views of parameters
                    if not self.mixed:
                        for p in self.params:
                            g, dtype, o = self._spans[p]
                            self._full[g][dtype]["param"][o:o + p.numel()].copy_(p.detach().reshape(-1))
                    # megatron copies every per-slice state key, and the world tensors have no
                    # "step" (torch's Adam keeps one per slice): set it aside for the copy.
                    steps = {q: st.pop("step") for q, st in self.opt.state.items() if "step" in st}
                    self.dopt.load_parameter_state_from_dp_zero(self._full)
                    for q, step in steps.items():
                        self.opt.state[q]["step"] = step
        finally:
            self._full = None

    def state_tensors(self, p: torch.nn.Parameter) -> dict:
        """Whole per-parameter state of model parameter ``p``, shaped like it, as views into the
        tensors ``full_state`` gathered (only valid inside it)."""
        if self._full is None:
            raise RuntimeError("MegatronDistributedAdamW.state_tensors is only valid inside full_state()")
        g, dtype, o = self._spans[p]
        world = self._full[g][dtype]
        keys = _MOMENTS + (("param",) if self.mixed else ())
        return {("main_param" if k == "param" else k): world[k][o:o + p.numel()].view(p.shape)
                for k in keys}

    @property
    def adam_step(self) -> float:
        for group in self.opt.param_groups:
            if "step" in group:
                return float(group["step"])
        for st in self.opt.state.values():
            if "step" in st:
                return float(st["step"])
        return 0.0

    @adam_step.setter
    def adam_step(self, value: float) -> None:
        self._ensure_state()
        for group in self.opt.param_groups:
            if self._torch_adam():
                for p in group["params"]:
                    self.opt.state[p]["step"] = torch.tensor(float(value))
            else:
                group["step"] = int(value)
