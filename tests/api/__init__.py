"""Snapshots of library signatures the GPU path calls (``tools/api_snapshot.py`` writes them), and
``signature()`` to turn one into an ``inspect.Signature`` that binds a call's arguments."""
from __future__ import annotations

import inspect
import json
from functools import lru_cache
from pathlib import Path

HERE = Path(__file__).resolve().parent
_KINDS = {"positional_only": inspect.Parameter.POSITIONAL_ONLY,
          "positional_or_keyword": inspect.Parameter.POSITIONAL_OR_KEYWORD,
          "var_positional": inspect.Parameter.VAR_POSITIONAL,
          "keyword_only": inspect.Parameter.KEYWORD_ONLY,
          "var_keyword": inspect.Parameter.VAR_KEYWORD}


@lru_cache(maxsize=None)
def snapshot(name: str) -> dict:
    """The snapshot ``tests/api/<name>.json`` (e.g. ``vllm-0.26.0``)."""
    return json.loads((HERE / f"{name}.json").read_text())


def signature(snap: dict, key: str, drop_self: bool = True) -> inspect.Signature:
    """``inspect.Signature`` of ``snap["signatures"][key]`` (defaults are placeholders)."""
    params = snap["signatures"][key]
    if drop_self and params and params[0]["name"] == "self":
        params = params[1:]
    return inspect.Signature([
        inspect.Parameter(p["name"], _KINDS[p["kind"]],
                          default=None if p["default"] else inspect.Parameter.empty)
        for p in params])
