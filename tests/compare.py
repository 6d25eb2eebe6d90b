"""The suite's one way to reduce differences between tensors: NaN and inf are kept.

Python's ``max(0.0, nan)`` is 0.0, so a per-tensor ``max(...)`` over differences (or a
running maximum that starts from 0.0) reports a NaN weight as "max diff 0.0", and a
``zip`` over two lists of different lengths compares only the common prefix. Every
helper here instead:

* returns NaN when any compared element is NaN (or when inf meets inf), so
  ``assert diff <= tol`` fails;
* refuses tensors of different shapes, dicts with different keys and sequences of
  different lengths, naming the mismatch;
* refuses to reduce nothing (an empty comparison proves nothing).

Use ``max_abs_diff`` for one pair, ``max_abs_diff_all`` for dicts or sequences of pairs,
``worst`` to combine floats (over ranks, over layouts), and ``assert_close`` where a
tolerance is checked at once (it wraps ``torch.testing.assert_close``, NaN never equal).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch


def max_abs_diff(a, b) -> float:
    """max |a - b| over all elements, in float64: NaN if any element of either is NaN,
    inf where an infinity meets anything but the same infinity (equal infinities, such
    as two masked -inf log-probs, count as equal).

    a, b: tensors (or numbers / nested lists torch.as_tensor accepts) of equal shape."""
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    if a.numel() == 0:
        raise ValueError("nothing to compare: both tensors are empty")
    a64, b64 = a.detach().cpu().double(), b.detach().cpu().double()
    diff = (a64 - b64).abs()
    # inf - inf would be NaN: equal infinities compare equal, any other pair is inf apart.
    diff = torch.where((a64 == b64), torch.zeros_like(diff), diff)
    if bool(torch.isnan(a64).any() or torch.isnan(b64).any()):
        return math.nan
    return float(diff.max())


def worst(values: Iterable[float]) -> float:
    """The largest of ``values``, NaN if any is NaN (Python's max drops NaN unless it
    comes first). Raises on an empty iterable."""
    out = None
    for v in values:
        v = float(v)
        if math.isnan(v):
            return math.nan
        out = v if out is None else max(out, v)
    if out is None:
        raise ValueError("nothing to compare: no values")
    return out


def max_abs_diff_all(a: Mapping | Sequence, b: Mapping | Sequence, keys: Iterable | None = None) -> float:
    """``worst`` of ``max_abs_diff`` over matching entries of two dicts (same keys, or
    only ``keys``) or two sequences (same length)."""
    if isinstance(a, Mapping) != isinstance(b, Mapping):
        raise TypeError(f"cannot compare a {type(a).__name__} with a {type(b).__name__}")
    if isinstance(a, Mapping):
        if keys is None:
            if a.keys() != b.keys():
                raise ValueError(f"keys differ: {sorted(set(a) ^ set(b), key=str)}")
            keys = list(a)
        keys = list(keys)
        missing = [k for k in keys if k not in a or k not in b]
        if missing:
            raise ValueError(f"keys missing from one side: {missing}")
        return worst(max_abs_diff(a[k], b[k]) for k in keys)
    if len(a) != len(b):
        raise ValueError(f"lengths differ: {len(a)} vs {len(b)}")
    return worst(max_abs_diff(x, y) for x, y in zip(a, b))


def worst_over_ranks(results: Sequence[Mapping], key: str) -> dict:
    """Per entry name, ``worst`` of ``r[name][key]`` over every rank's report ``r`` that
    has it (results: one ``{name: {key: float}}`` per rank)."""
    merged: dict = {}
    for r in results:
        for name, v in r.items():
            if key in v:
                merged.setdefault(name, []).append(v[key])
    return {name: worst(vs) for name, vs in merged.items()}


def assert_close(actual, expected, *, atol: float, rtol: float = 0.0, msg: str = "") -> None:
    """``torch.testing.assert_close`` with NaN never equal, dtypes and devices free
    (both compared in float64 on the CPU); ``msg`` prefixes the failure message."""
    a = torch.as_tensor(actual).detach().cpu().double()
    e = torch.as_tensor(expected).detach().cpu().double()
    torch.testing.assert_close(a, e, atol=atol, rtol=rtol, equal_nan=False,
                               msg=(lambda m: f"{msg}: {m}") if msg else None)
