"""LoRA adapters on megatron's tensor-parallel linears (``model.lora``; docs/guides/lora.md).

What: each targeted linear (``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2`` of
every layer) gets two parameters beside its frozen weight W, and its output gains
``scale * B A x`` with ``scale = alpha / rank``:

* column-parallel (qkv, fc1; W is split by output rows over TP): A ``[r, in]`` is replicated,
  B ``[out/tp, r]`` holds the same rows as W's shard (so fused q/k/v and gate/up rows follow
  megatron's interleaved layout). ``h = x A^T`` is the same on every TP rank; it enters the
  tensor-parallel region through ``copy_to_tensor_model_parallel_region``, whose backward sums
  the ranks' partial input gradients, so dA (and dx) is the full one on every rank.
* row-parallel (proj, fc2; W is split by input columns): A ``[r, in/tp]`` holds W's columns,
  B ``[out, r]`` is replicated. ``h = sum over TP of x_local A_local^T`` through
  ``reduce_from_tensor_model_parallel_region`` (all-reduce forward, identity backward), then
  ``B h`` is the same on every rank, so dB is too.

The result is the same at TP 1, 2 and 4 (tests/unit/lora). Adapters attach in place, by a
forward hook: the base parameters keep their names, so mapping tables, base checkpoints and
exports are untouched; the adapter's are ``<linear>.lora_A.weight`` and ``<linear>.lora_B.weight``.
``adapters_disabled`` turns every hook off: the model is then exactly the frozen base, which is
the KL reference (no second model). Not supported (refused at start-up, ``preflight/lora.py``):
the Transformer Engine spec (its qkv and fc1 fuse the layer norm, so the adapter would not see
the normed input), sequence parallelism, MoE models.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
from typing import Callable, Iterator

import torch

from grpo_mega.config import LoraConfig
from grpo_mega.models.gpt import unwrap_model
from grpo_mega.models.layout import expert_offset, to_global_name

__all__ = ["attach_lora", "adapted_modules", "lora_named_parameters", "is_lora_name", "adapters_disabled",
           "merged_local_weight", "LORA_INITS", "lora_parameter_count", "ReferenceView"]

COLUMN, ROW = ("linear_qkv", "linear_fc1"), ("linear_proj", "linear_fc2")


def _kaiming(shape: tuple[int, int], g: torch.Generator) -> torch.Tensor:
    """PEFT's default A: kaiming-uniform with a = sqrt(5), i.e. uniform in +-1/sqrt(in)."""
    return (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1) / math.sqrt(shape[1])


def _gaussian(shape: tuple[int, int], g: torch.Generator) -> torch.Tensor:
    """PEFT's ``gaussian`` A: normal with std 1/rank."""
    return torch.randn(shape, generator=g, dtype=torch.float64) / shape[0]


LORA_INITS: dict[str, Callable[[tuple[int, int], torch.Generator], torch.Tensor]] = {
    "kaiming": _kaiming, "gaussian": _gaussian}
"""``model.lora.init``: how the full A ``[r, in]`` is drawn (B starts at zero)."""


def is_lora_name(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def _seed(seed: int, global_name: str) -> int:
    # per linear and layout-free: every TP/PP layout draws the same full A for a layer
    return int.from_bytes(hashlib.sha256(f"{seed}:{global_name}".encode()).digest()[:8], "little") % 2**63


def _param(t: torch.Tensor, like: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t.to(device=like.device, dtype=like.dtype).contiguous())


def _hook(module, args, kwargs, output):
    """The adapted linear's forward hook: adds scale * B A x to megatron's ``(out, bias)``."""
    if not module.lora_enabled:
        return output
    from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                        reduce_from_tensor_model_parallel_region)
    x = args[0] if args else kwargs["input_"]
    if module.training and module.lora_dropout > 0:
        x = torch.nn.functional.dropout(x, module.lora_dropout)
    a, b = module.lora_A.weight, module.lora_B.weight
    h = torch.matmul(x, a.t())  # [.., r]
    if module.lora_parallel == "column":
        h = copy_to_tensor_model_parallel_region(h, group=module.lora_tp_group) if module.lora_tp > 1 else h
    elif module.lora_tp > 1:
        h = reduce_from_tensor_model_parallel_region(h, group=module.lora_tp_group)
    out, *rest = output
    return (out + module.lora_scale * torch.matmul(h, b.t()), *rest)


def attach_lora(model, lora: LoraConfig, ps, seed: int = 0) -> None:
    """Add adapters to this stage's targeted linears and freeze every base parameter.

    A is drawn whole from ``seed`` and the linear's global name (``lora.init``), then this
    rank's columns taken for a row-parallel linear; B is zero, so the adapted model starts as
    the base model. Raises ValueError for a target that is not a plain tensor-parallel linear."""
    gpt = unwrap_model(model)
    per = gpt.config.num_layers // ps.pp
    off = expert_offset(gpt, ps)
    for p in gpt.parameters():
        p.requires_grad_(False)
    found = 0
    for name, mod in list(gpt.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in lora.target_modules:
            continue
        if ".experts." in name or ".mlp.experts" in name:
            raise ValueError(f"{name}: MoE expert linears are not adapted; drop linear_fc1/linear_fc2 "
                             "from --model.lora.target_modules or train without model.lora")
        w = getattr(mod, "weight", None)
        if w is None or w.dim() != 2 or type(mod).__name__ not in ("ColumnParallelLinear", "RowParallelLinear"):
            raise ValueError(f"{name} is a {type(mod).__name__}, not megatron's local-spec "
                             "Column/RowParallelLinear; LoRA needs --model.transformer_impl=local")
        parallel = "column" if leaf in COLUMN else "row"
        out_local, in_local = w.shape
        in_full = in_local * (ps.tp if parallel == "row" else 1)
        g = torch.Generator().manual_seed(_seed(seed, to_global_name(name, ps.pp_rank, per, off)))
        a = LORA_INITS[lora.init]((lora.rank, in_full), g)
        if parallel == "row":
            a = a[:, ps.tp_rank * in_local:(ps.tp_rank + 1) * in_local]
        mod.lora_A, mod.lora_B = torch.nn.Module(), torch.nn.Module()
        mod.lora_A.weight = _param(a, w)
        mod.lora_B.weight = _param(torch.zeros(out_local, lora.rank, dtype=torch.float64), w)
        # megatron's grad finalisation and optimizers read these on TP parameters: the one of
        # A and B that is split over TP follows W (column: B's rows; row: A's columns)
        split = mod.lora_B.weight if parallel == "column" else mod.lora_A.weight
        for p, dim in ((mod.lora_A.weight, 1), (mod.lora_B.weight, 0)):
            p.tensor_model_parallel, p.partition_dim, p.partition_stride = p is split, dim, 1
        mod.lora_scale, mod.lora_parallel, mod.lora_dropout = lora.alpha / lora.rank, parallel, lora.dropout
        mod.lora_tp, mod.lora_tp_group, mod.lora_enabled = ps.tp, ps.tp_group, True
        mod.register_forward_hook(_hook, with_kwargs=True)
        found += 1
    if found == 0 and any(True for _ in gpt.parameters()):
        raise ValueError(f"no linear of this stage matches model.lora.target_modules={lora.target_modules}")


def adapted_modules(model) -> dict[str, torch.nn.Module]:
    """Local qualified name -> module, for every linear of this stage carrying an adapter."""
    return {n: m for n, m in unwrap_model(model).named_modules() if hasattr(m, "lora_scale")}


def lora_named_parameters(model) -> list[tuple[str, torch.nn.Parameter]]:
    """This rank's adapter parameters, with their local names."""
    return [(n, p) for n, p in unwrap_model(model).named_parameters() if is_lora_name(n)]


def lora_parameter_count(model) -> int:
    return sum(p.numel() for _, p in lora_named_parameters(model))


@contextlib.contextmanager
def adapters_disabled(model) -> Iterator[None]:
    """Inside, every adapter is off: the model computes its frozen base exactly."""
    mods = list(adapted_modules(model).values())
    before = [m.lora_enabled for m in mods]
    for m in mods:
        m.lora_enabled = False
    try:
        yield
    finally:
        for m, on in zip(mods, before):
            m.lora_enabled = on


def merged_local_weight(module) -> torch.Tensor:
    """``W_local + scale * B_local A_local``: the local shard of the merged weight, with the
    base weight's shape and sharding (column: B's rows, A whole; row: A's columns, B whole)."""
    a, b = module.lora_A.weight.detach(), module.lora_B.weight.detach()
    return module.weight.detach() + module.lora_scale * (b @ a)


class ReferenceView(torch.nn.Module):
    """The KL reference of a LoRA actor: the actor itself with its adapters off, under no_grad.

    Holds no weights of its own: the actor is kept outside the module tree, so its state dict
    is empty and nothing is saved twice (``parameters()`` gives the actor's, for megatron's
    schedule, which reads the activation dtype from them). Attribute lookups it
    does not answer go to the actor (megatron's schedule reads ``config``; ``models.head`` the
    output layer). At PP > 1 the schedule hands the reference its own input tensor: kept here
    and set on the actor just before the reference forward, after the policy's has run."""

    def __init__(self, actor):
        super().__init__()
        object.__setattr__(self, "_actor", actor)
        object.__setattr__(self, "_input", None)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_actor"), name)

    @property
    def actor(self):
        return object.__getattribute__(self, "_actor")

    def parameters(self, recurse: bool = True):
        # megatron's schedule reads the activation dtype from the first parameter
        return self.actor.parameters(recurse)

    def set_input_tensor(self, input_tensor) -> None:
        object.__setattr__(self, "_input", input_tensor)

    def forward(self, *args, **kwargs):
        actor = self.actor
        if object.__getattribute__(self, "_input") is not None:
            actor.set_input_tensor(object.__getattribute__(self, "_input"))
        with adapters_disabled(actor), torch.no_grad():
            return actor(*args, **kwargs)
