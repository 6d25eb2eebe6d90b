"""benchmarks/gpu.py: refuses to report figures without a GPU, and its code runs (CPU smoke)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests import REPO

ROOT = REPO


def _run(*args, out_dir):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "benchmarks/gpu.py", "--out-dir", str(out_dir), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")
def test_gpu_benchmark_refuses_without_gpu_and_smoke_runs_every_section(tmp_path):
    """Guards against CPU numbers landing in the GPU results file, and against a GPU
    script that has never run end to end (it would first fail on the lent GPU)."""
    refused = _run(out_dir=tmp_path)
    assert refused.returncode == 2 and "needs a CUDA GPU" in refused.stderr, refused.stderr[-2000:]
    smoke = _run("--cpu-smoke", out_dir=tmp_path)
    assert smoke.returncode == 0, smoke.stdout[-2000:] + smoke.stderr[-3000:]
    assert "CPU smoke (not a GPU figure)" in smoke.stdout
    rows = [ln for ln in smoke.stdout.splitlines() if ln.startswith("| ") and "section" not in ln]
    sections = {ln.split("|")[1].strip() for ln in rows}
    assert sections == {"train", "ref", "loss", "bridge"}, rows
    timed = [ln for ln in rows if "not run" not in ln and "not measured" not in ln]
    assert all(float(ln.split("|")[5]) > 0 for ln in timed), timed
    assert not list(tmp_path.iterdir())  # no results file from a CPU run
