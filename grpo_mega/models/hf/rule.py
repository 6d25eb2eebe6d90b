"""The row type of the per-family mapping tables (``llama.py``, ``qwen2.py``, ``qwen3.py``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Rule:
    """One canonical tensor and the HF tensor(s) it corresponds to."""

    mcore: str
    """Canonical name pattern (``{i}``: global layer index)."""
    hf: tuple[str, ...]
    """HF name patterns, in the order the converter takes/produces them."""
    kind: str
    """Converter: ``copy``, ``vocab``, ``qkv`` or ``gate_up``."""
    shape: tuple[str, ...]
    """Canonical shape in named dims (see ``_dims``)."""
    when: Optional[str] = None
    """None (always), ``qkv_bias``, ``untied``, ``qk_norm`` or ``alias`` (export-only spelling)."""
