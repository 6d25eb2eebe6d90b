"""The Transformer Engine modules megatron's TE spec builds, reduced to their parameters.

Names and shapes follow Transformer Engine 2.x (``transformer_engine/pytorch/module/``):
  Linear            weight [out/tp (column) or out, in/tp (row) or in], bias if asked
  LayerNormLinear   layer_norm_weight [in] (+ layer_norm_bias for LayerNorm), weight, bias
  GroupedLinear     weight0..weight{n-1} (each like Linear's weight), bias0.. if asked
  RMSNorm/LayerNorm weight [hidden] (+ bias for LayerNorm)
  DotProductAttention  no parameters
Every module carries TE's ``_extra_state`` (FP8 metadata; empty here). A disabled bias is a
plain empty tensor attribute, as in TE, not a parameter.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from transformer_engine.pytorch import distributed, fp8, ops  # noqa: F401
from transformer_engine.pytorch.distributed import CudaRNGStatesTracker  # noqa: F401
from transformer_engine.pytorch.fp8 import fp8_autocast, fp8_model_init  # noqa: F401


class _TEModule(torch.nn.Module):
    """TransformerEngineBaseModule's state-dict surface: an ``_extra_state`` entry."""

    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        pass

    def forward(self, *args, **kwargs):
        raise NotImplementedError("transformer_engine stub: parameter names only, no forward")


def _param(shape, dtype, device, init: Optional[Callable], fill: Optional[float] = None):
    p = torch.nn.Parameter(torch.empty(shape, dtype=dtype or torch.float32, device=device or "cpu"))
    with torch.no_grad():
        if fill is not None:
            p.fill_(fill)
        elif init is not None:
            init(p)
        else:
            p.zero_()
    return p


def _linear_attrs(mod, in_features: int, out_features: int, parallel_mode: Optional[str], tp_size: int,
                  bias: bool, return_bias: bool) -> None:
    """TE's linear attributes; ``in/out_features`` are this TP rank's (TE divides them)."""
    if parallel_mode == "column":
        out_features //= tp_size
    elif parallel_mode == "row":
        in_features //= tp_size
    mod.in_features, mod.out_features = in_features, out_features
    mod.use_bias, mod.return_bias = bias, return_bias
    mod.tp_size, mod.parallel_mode = tp_size, parallel_mode


def _weight_and_bias(mod, init_method, params_dtype, device, suffix: str = "") -> None:
    """``weight{suffix}`` [out, in] and ``bias{suffix}`` (a parameter only when used)."""
    mod.register_parameter("weight" + suffix, _param((mod.out_features, mod.in_features), params_dtype,
                                                     device, init_method))
    if mod.use_bias:
        mod.register_parameter("bias" + suffix, _param((mod.out_features,), params_dtype, device, None))
    else:
        setattr(mod, "bias" + suffix, torch.empty(0, dtype=params_dtype, device=device))


class Linear(_TEModule):
    def __init__(self, in_features: int, out_features: int, *, bias: bool = True,
                 init_method: Optional[Callable] = None, tp_size: int = 1,
                 parallel_mode: Optional[str] = None, params_dtype=None, device=None,
                 return_bias: bool = False, **_ignored):
        super().__init__()
        _linear_attrs(self, in_features, out_features, parallel_mode, tp_size, bias, return_bias)
        _weight_and_bias(self, init_method, params_dtype, device)


class LayerNormLinear(_TEModule):
    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5, *, bias: bool = True,
                 init_method: Optional[Callable] = None, tp_size: int = 1,
                 parallel_mode: Optional[str] = None, params_dtype=None, device=None,
                 normalization: str = "LayerNorm", return_bias: bool = False, **_ignored):
        super().__init__()
        _linear_attrs(self, in_features, out_features, parallel_mode, tp_size, bias, return_bias)
        self.eps, self.normalization = eps, normalization
        self.layer_norm_weight = _param((in_features,), params_dtype, device, None, fill=1.0)
        if normalization == "LayerNorm":
            self.layer_norm_bias = _param((in_features,), params_dtype, device, None)
        _weight_and_bias(self, init_method, params_dtype, device)


class GroupedLinear(_TEModule):
    def __init__(self, num_gemms: int, in_features: int, out_features: int, *, bias: bool = True,
                 init_method: Optional[Callable] = None, tp_size: int = 1,
                 parallel_mode: Optional[str] = None, params_dtype=None, device=None,
                 return_bias: bool = False, **_ignored):
        super().__init__()
        self.num_gemms = num_gemms
        _linear_attrs(self, in_features, out_features, parallel_mode, tp_size, bias, return_bias)
        self.fp8 = self.fp8_calibration = False
        self.fp8_meta = {"fp8_checkpoint": False, "recipe": None}
        for i in range(num_gemms):
            _weight_and_bias(self, init_method, params_dtype, device, suffix=str(i))

    def init_fp8_metadata(self, num_gemms: int = 1) -> None:
        pass


class RMSNorm(_TEModule):
    """TE 2.x's first argument is ``normalized_shape`` (megatron-core 0.19 passes it by name)."""

    def __init__(self, normalized_shape, eps: float = 1e-5, *, params_dtype=None, device=None, **_ignored):
        super().__init__()
        self.eps = eps
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        self.weight = _param(shape, params_dtype, device, None, fill=1.0)


class LayerNorm(RMSNorm):
    def __init__(self, normalized_shape, eps: float = 1e-5, *, params_dtype=None, device=None, **_ignored):
        super().__init__(normalized_shape, eps, params_dtype=params_dtype, device=device)
        self.bias = _param(self.weight.shape, params_dtype, device, None)


class DotProductAttention(_TEModule):
    def __init__(self, num_attention_heads: int, kv_channels, **_ignored):
        super().__init__()
        self.num_attention_heads, self.kv_channels = num_attention_heads, kv_channels
