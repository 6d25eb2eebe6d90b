"""``grpo_mega.runtime.dist_cache``: transformers' ``packages_distributions()`` comes from a
file written once, and never from a stale one."""
from __future__ import annotations

import importlib.metadata
import os
import sys

import pytest


@pytest.fixture
def cache(tmp_path, monkeypatch):
    from grpo_mega.runtime import dist_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    calls = []
    monkeypatch.setattr(dist_cache, "_REAL", lambda: calls.append(1) or {"pkg": ["dist"]})
    yield dist_cache, calls, tmp_path


def test_dist_cache_answers_from_the_file_and_recomputes_after_an_install(cache, monkeypatch):
    """Guards the cache going stale (a package installed, upgraded or removed on a sys.path
    entry must recompute, or transformers looks up the wrong distribution) or never being
    read (every process pays the 0.25 s scan again)."""
    dist_cache, calls, tmp_path = cache
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.setattr(sys, "path", [str(site)])
    assert dist_cache.cached_packages_distributions() == {"pkg": ["dist"]} and len(calls) == 1
    assert dist_cache.cached_packages_distributions() == {"pkg": ["dist"]} and len(calls) == 1
    (site / "new-1.0.dist-info").mkdir()  # an install changes the folder's mtime
    st = os.stat(site)
    os.utime(site, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert dist_cache.cached_packages_distributions() == {"pkg": ["dist"]} and len(calls) == 2


def test_dist_cache_is_installed_by_importing_grpo_mega_and_matches_the_real_scan(tmp_path, monkeypatch):
    """Guards the wrapper dropped from grpo_mega/__init__ or answering something else than
    importlib's own scan."""
    import grpo_mega  # noqa: F401
    from grpo_mega.runtime import dist_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    dist_cache.cached_packages_distributions()  # writes the file
    assert importlib.metadata.packages_distributions is dist_cache.cached_packages_distributions
    assert dist_cache.cached_packages_distributions() == dist_cache._REAL()
