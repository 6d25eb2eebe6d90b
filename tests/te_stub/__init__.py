"""A stand-in ``transformer_engine`` package for CPU tests: megatron builds its Transformer
Engine layer spec with it, so the tests see the parameter names and sharded-state keys a
GPU run gets, without CUDA.

It registers parameters exactly as Transformer Engine 2.x names them (``weight``/``bias``;
``layer_norm_weight`` in LayerNormLinear; ``weight0..weight{n-1}`` in GroupedLinear; a
``_extra_state`` on every module) with TE's tensor-parallel shapes, and nothing else:
forward raises. Everything megatron does with these modules (wrappers, spec provider,
sharded state dicts) is megatron's own code.

Only a fresh process may use it: megatron decides ``HAVE_TE`` when its modules are first
imported. ``activate()`` puts the package on ``sys.path`` and refuses if megatron or a
real Transformer Engine is already imported.
"""
from __future__ import annotations

import sys
from pathlib import Path

STUB_ROOT = str(Path(__file__).resolve().parent)


def activate() -> None:
    """Make ``import transformer_engine`` find the stub (call before importing megatron)."""
    loaded = [m for m in ("megatron.core", "transformer_engine") if m in sys.modules]
    if loaded:
        raise RuntimeError(f"te_stub.activate() after {loaded} was imported: megatron has already "
                           "decided whether Transformer Engine is present; call it first in a fresh process")
    if STUB_ROOT not in sys.path:
        sys.path.insert(0, STUB_ROOT)
