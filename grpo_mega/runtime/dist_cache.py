"""Cache ``importlib.metadata.packages_distributions()`` on disk (0.25 s of every process).

transformers calls it once at import to map import names to distributions; it reads every
installed distribution's metadata, the same answer in every rank, engine server and test
process. ``install()`` wraps it with a file cache keyed on the Python version and each
``sys.path`` entry with its mtime (installing, upgrading or removing a package adds or renames
a ``*.dist-info`` folder there, which changes the folder's mtime, so a stale answer is never
read). Any cache failure falls back to the real call.
"""
from __future__ import annotations

import hashlib
import importlib.metadata as _metadata
import json
import os
import sys
from pathlib import Path

_REAL = _metadata.packages_distributions


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/grpo_mega`` (``~/.cache/grpo_mega`` by default)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "grpo_mega"


def _key() -> str:
    parts = [sys.version]
    for entry in sys.path:
        p = os.path.abspath(entry or os.getcwd())
        try:
            parts.append(f"{p}:{os.stat(p).st_mtime_ns}")
        except OSError:
            parts.append(f"{p}:-")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def cached_packages_distributions():
    """``packages_distributions()``, from the cache when its key matches."""
    try:
        path = cache_dir() / f"packages_distributions-{_key()}.json"
        if path.is_file():
            return json.loads(path.read_text())
    except (OSError, ValueError):
        return _REAL()
    mapping = _REAL()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(mapping))
        os.replace(tmp, path)  # atomic: concurrent ranks never read half a file
    except OSError:
        pass
    return mapping


def install() -> None:
    """Idempotent; ``GRPO_MEGA_DIST_CACHE=0`` turns it off."""
    if os.environ.get("GRPO_MEGA_DIST_CACHE", "1") != "0":
        _metadata.packages_distributions = cached_packages_distributions
