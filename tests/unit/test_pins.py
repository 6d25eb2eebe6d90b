"""One version of each GPU-path library, named the same in every place that installs or checks it
(issue 39): setup.py (``install_requires`` and the ``gpu`` extra), the Makefile's megatron-core
step, the offline wheel lists (tools/wheels/*.txt) and the API snapshots the GPU tests bind to.
The support matrix (docs/support-matrix.md) is generated from the same setup.py pins.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_pins.py
"""
from __future__ import annotations

import re
import subprocess
import sys
from importlib.metadata import version

from tests import REPO

sys.path.insert(0, str(REPO / "tools"))

import gen_docs  # noqa: E402

PINS = gen_docs.setup_pins()


def _wheel_list(tier: str) -> dict[str, str]:
    """``{name: version}`` of tools/wheels/<tier>.txt (``name==version  # why`` lines)."""
    lines = (REPO / "tools" / "wheels" / f"{tier}.txt").read_text().splitlines()
    return dict(m.groups() for m in (re.match(r"^([\w.-]+)==(\S+)", ln) for ln in lines) if m)


def test_one_megatron_core_on_cpu_and_gpu():
    """Bugs: the CPU suite testing another megatron-core than the GPU installs (0.16.1 on Python
    3.11 against an unbounded ``>=0.16.1`` on 3.12); a ``python_version`` marker splitting the pin
    again; the Makefile pre-installing another version than setup.py pins (pip would then
    reject it or the suite would run the wrong one), or with its dependencies, or skipping
    the Python check for any other install; the lite wheel list or the API snapshot naming
    another; a venv left on the old version (the suite then vouches for nothing)."""
    setup_text = (REPO / "setup.py").read_text()
    assert "python_version" not in "".join(ln for ln in setup_text.splitlines() if "megatron-core" in ln)
    pin = PINS["install"]["megatron-core"]
    assert PINS["gpu"]["megatron-core"] == pin
    recipe = subprocess.run(["make", "-n", "-B", "-C", str(REPO), ".venv/.grpo-mega-installed"],
                            capture_output=True, text=True, timeout=60).stdout
    forced = [ln for ln in recipe.splitlines() if "pip install" in ln and "--ignore-requires-python" in ln]
    assert len(forced) == 1 and "--no-deps" in forced[0] and f"'megatron-core=={pin}'" in forced[0], recipe
    assert _wheel_list("lite")["megatron-core"] == pin
    assert (REPO / "tests" / "api" / f"megatron-core-{pin}.json").is_file()
    api_test = (REPO / "tests" / "unit" / "models" / "test_megatron_gpu_api.py").read_text()
    assert f'snapshot("megatron-core-{pin}")' in api_test
    assert version("megatron-core") == pin, "this venv predates the pin: rebuild it (make clean-env env)"


def test_gpu_extra_pins_every_package_exactly_as_the_wheel_lists_and_snapshots():
    """Bugs: a ``gpu`` extra entry left unpinned or as a range (a GPU install then takes whatever
    is newest: another vLLM or TE than the API snapshots and the docs name); the extra and the
    wheel lists (tools/wheels/*.txt) naming different versions of vLLM, TE or math-verify."""
    gpu_reqs = gen_docs.setup_requirements()["gpu"]
    assert len(gpu_reqs) == len(PINS["gpu"]), f"not pinned with ==: {gpu_reqs} vs {PINS['gpu']}"
    wheels = {**_wheel_list("lite"), **_wheel_list("full")}
    gpu = PINS["gpu"]
    assert wheels["vllm"] == gpu["vllm"] and wheels["math-verify"] == gpu["math-verify"]
    assert wheels["transformer-engine"] == wheels["transformer-engine-cu13"] == gpu["transformer-engine"]
    assert (REPO / "tests" / "api" / f"vllm-{gpu['vllm']}.json").is_file()
