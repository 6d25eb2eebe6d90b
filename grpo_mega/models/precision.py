"""Numeric precision: parameter dtype, FP8 through Transformer Engine, and what the GPU supports.

What
    * ``fp8_problem``: a pure check of an FP8 request against the hardware and
      software at hand (CUDA present, compute capability, TE installed and its
      version). It returns the reason FP8 cannot run, or None. ``validate``
      calls it through ``check_fp8_here`` before any process group exists, so a
      bad request fails at start-up naming what is missing and the flag.
    * ``fp8_transformer_fields``: the megatron ``TransformerConfig`` fields for
      an FP8 model. megatron then enters TE's ``fp8_autocast`` with the recipe
      inside every transformer block; nothing else in the loop changes.
    * ``seq_multiple``: TE's FP8 GEMMs need the token count of a micro-batch
      to be a multiple of 16 (32 for mxfp8), per TP rank with sequence parallelism,
      so micro-batches are padded to it.
    * ``te_install_command``: how to install TE against the installed torch, named
      by the error when TE does not import.

Why these minimums
    FP8 tensor cores exist from compute capability 8.9 (Ada, Hopper). The
    recipes need (megatron-core 0.19.2 ``fp8_utils.get_fp8_recipe``):
    ``delayed`` any TE 1.x+, ``tensorwise`` (current scaling) TE >= 2.2,
    ``blockwise`` TE >= 2.3 and Hopper (sm90) or newer (Blackwell emulates it),
    ``mxfp8`` TE >= 2.1 and Blackwell (sm100). Where TE offers its own support check it is asked too,
    because it also knows the CUDA toolkit it was built with.

Nothing here was run on a GPU in this repository's CI; the checks are tested
on CPU with the hardware facts passed in.
"""
from __future__ import annotations

import logging

from typing import Optional, Tuple

FP8_FORMATS = ("none", "hybrid", "e4m3")
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")

# recipe -> (minimum compute capability, minimum TE version)

def te_import_error() -> Optional[str]:
    """None when Transformer Engine's torch module imports, else why not ("not installed",
    or the exception of a broken install: the CPU meta package raises RuntimeError)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
        return None
    except ModuleNotFoundError as e:
        if e.name in ("transformer_engine", "transformer_engine.pytorch"):
            return "not installed"
        return f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


def te_available() -> bool:
    """True when Transformer Engine's torch module imports (any exception means absent)."""
    return te_import_error() is None


TRANSFORMER_IMPLS = ("auto", "transformer_engine", "local")


# The gpu extra's Transformer Engine (setup.py; a test keeps the two equal).
TE_VERSION = "2.20.2"


def te_install_command(cuda: Optional[str] = "13", *, reinstall: bool = False) -> str:
    """The pip command that installs Transformer Engine ``TE_VERSION`` against the torch
    already installed: its torch part is a source archive, and pip's default build isolation
    compiles it against another torch (the newest on PyPI), whose ABI the installed one
    lacks, so the import then fails. ``cuda``: torch's CUDA major version (the core wheel is
    per CUDA major; None: 13). ``reinstall``: replace a broken build; without
    ``--no-cache-dir`` pip would reuse the wheel it built before."""
    if reinstall:
        return ("pip install --no-build-isolation --no-deps --force-reinstall --no-cache-dir "
                f"transformer-engine-torch=={TE_VERSION}")
    major = (cuda or "13").split(".")[0]
    return f"pip install --no-build-isolation 'transformer-engine[core_cu{major},pytorch]=={TE_VERSION}'"


def choose_te(device_type: str, impl: str = "auto") -> bool:
    """Whether to build the TE layer spec for ``model.transformer_impl=impl`` on a
    ``device_type`` job. Never a silent fallback on GPU: a TE that is required or installed
    but fails to import is an error; a missing one under ``auto`` a loud warning (unfused
    attention with [b, heads, s, s] scores, slower and larger than the budget counts)."""
    if impl not in TRANSFORMER_IMPLS:
        raise ValueError(f"model.transformer_impl={impl!r} is not one of {TRANSFORMER_IMPLS} "
                         "(--model.transformer_impl)")
    if impl == "local":
        return False
    if device_type != "cuda":
        if impl == "transformer_engine":
            raise RuntimeError("model.transformer_impl=transformer_engine needs a CUDA GPU; "
                               "use --model.transformer_impl=auto or local on CPU")
        return False
    why = te_import_error()
    if why is None:
        return True
    import torch
    install = te_install_command(torch.version.cuda)
    if why == "not installed" and impl == "transformer_engine":
        raise RuntimeError("Transformer Engine is not installed, and --model.transformer_impl="
                           f"transformer_engine requires it: {install}; or build megatron's "
                           "local layers with --model.transformer_impl=local")
    if why != "not installed":
        raise RuntimeError(
            f"Transformer Engine does not import ({why}). A TE whose torch part was compiled "
            "against another torch fails this way: pip builds transformer-engine-torch (a source "
            "archive) in an isolated environment with the newest torch from PyPI unless told not "
            f"to. Rebuild it against this torch: {te_install_command(reinstall=True)}; or build "
            "megatron's local layers on purpose with --model.transformer_impl=local")
    logging.getLogger("grpo_mega.models").warning(
        "Transformer Engine is not installed: building megatron's LOCAL layers on a GPU (unfused "
        "attention with [b, heads, s, s] scores, no FP8). Install TE against this torch (%s) or "
        "pass --model.transformer_impl=local to silence this.", install)
    return False


_RECIPE_NEEDS = {
    "delayed": ((8, 9), (1, 0)),
    "tensorwise": ((8, 9), (2, 2)),
    "blockwise": ((9, 0), (2, 3)),
    "mxfp8": ((10, 0), (2, 1)),
}
# No upper bound: TE runs ``blockwise`` natively on Hopper and emulates it on Blackwell (its
# support matrix; its own probe, asked by check_fp8_here, says where its version cannot).

FP8_SEQ_MULTIPLE = 16


def _version_tuple(text: Optional[str]) -> Optional[Tuple[int, int]]:
    if not text:
        return None
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    while len(parts) < 2:
        parts.append(0)
    return parts[0], parts[1]


def fp8_problem(fp8: str, recipe: str, *, cuda: bool, capability: Optional[Tuple[int, int]],
                te_version: Optional[str], device_name: str = "this GPU") -> Optional[str]:
    """Why FP8 ``fp8`` with ``recipe`` cannot run here, or None when it can.

    Args:
        fp8: ``model.fp8`` (``none`` always passes).
        recipe: ``model.fp8_recipe``.
        cuda: a CUDA device is present.
        capability: its compute capability (major, minor), None without CUDA.
        te_version: ``transformer_engine.__version__``, None when TE does not import.
        device_name: for the message.
    """
    if fp8 == "none":
        return None
    if fp8 not in FP8_FORMATS:
        return f"model.fp8={fp8!r} is not one of {FP8_FORMATS}"
    if recipe not in _RECIPE_NEEDS:
        return f"model.fp8_recipe={recipe!r} is not one of {FP8_RECIPES}"
    if not cuda:
        return "FP8 needs a CUDA GPU, and none is available"
    need_cc, need_te = _RECIPE_NEEDS[recipe]
    if capability is None or tuple(capability) < need_cc:
        have = "unknown" if capability is None else f"{capability[0]}.{capability[1]}"
        return (f"FP8 recipe {recipe!r} needs compute capability >= {need_cc[0]}.{need_cc[1]}, "
                f"but {device_name} has {have}")
    have_te = _version_tuple(te_version)
    if have_te is None:
        return "FP8 needs Transformer Engine, which does not import here (install the gpu extra)"
    if have_te < need_te:
        return (f"FP8 recipe {recipe!r} needs Transformer Engine >= {need_te[0]}.{need_te[1]}, "
                f"but {te_version} is installed")
    return None


def _te_version() -> Optional[str]:
    if not te_available():
        return None
    import transformer_engine
    return getattr(transformer_engine, "__version__", "0.0")


def _te_own_check(recipe: str) -> Optional[str]:
    """TE's own support probe, where this TE version has one (it knows its CUDA build)."""
    try:
        from transformer_engine.pytorch import fp8 as te_fp8
    except Exception:  # noqa: BLE001 - TE versions moved these; absent means no opinion
        return None
    probe = {"mxfp8": "check_mxfp8_support", "blockwise": "check_fp8_block_scaling_support"
             }.get(recipe, "check_fp8_support")
    fn = getattr(te_fp8, probe, None)
    if fn is None:
        return None
    ok, reason = fn()
    return None if ok else f"Transformer Engine says FP8 recipe {recipe!r} is unsupported here: {reason}"


def check_fp8_here(fp8: str, recipe: str) -> Optional[str]:
    """``fp8_problem`` with this process's hardware and software facts."""
    if fp8 == "none":
        return None
    import torch
    cuda = torch.cuda.is_available()
    cap = torch.cuda.get_device_capability() if cuda else None
    name = torch.cuda.get_device_name() if cuda else "this machine"
    return fp8_problem(fp8, recipe, cuda=cuda, capability=cap, te_version=_te_version(),
                       device_name=name) or _te_own_check(recipe)


def fp8_enabled(m, *, frozen: bool) -> bool:
    """Does this model run FP8? The reference (frozen) one only with ``model.reference_fp8``."""
    return m.fp8 != "none" and (not frozen or m.reference_fp8)


def fp8_transformer_fields(m, *, enabled: bool) -> dict:
    """megatron ``TransformerConfig`` keyword arguments for FP8 (empty when disabled)."""
    if not enabled:
        return {}
    fields = dict(fp8=m.fp8, fp8_recipe=m.fp8_recipe, fp8_margin=0)
    if m.fp8_recipe == "delayed":
        fields.update(fp8_amax_history_len=m.fp8_amax_history_len,
                      fp8_amax_compute_algo=m.fp8_amax_compute_algo)
    return fields


def fp8_align_size(recipe: str) -> int:
    """Token alignment of TE's FP8 GEMMs for ``recipe``: megatron's ``get_fp8_align_size``
    where it exists (mxfp8 needs 32, its 32-element scaling blocks), else the same rule."""
    try:
        from megatron.core.enums import Fp8Recipe
        from megatron.core.fp8_utils import get_fp8_align_size
        return int(get_fp8_align_size(Fp8Recipe(recipe)))
    except (ImportError, AttributeError, ValueError):
        return 2 * FP8_SEQ_MULTIPLE if recipe == "mxfp8" else FP8_SEQ_MULTIPLE


def seq_multiple(m, tp: int = 1) -> int:
    """Pad micro-batch sequence lengths to this multiple: FP8 GEMMs' alignment (16; 32 for
    mxfp8), else 1; with sequence parallelism that alignment times tp. SP splits the
    sequence over the TP ranks and TE checks each rank's rows (s/tp) against the alignment
    before its all-gather, so s must be align x tp (lcm(align, tp) passes TP 2 but not 4)."""
    base = fp8_align_size(m.fp8_recipe) if m.fp8 != "none" else 1
    return base * tp if m.sequence_parallel and tp > 1 else base
