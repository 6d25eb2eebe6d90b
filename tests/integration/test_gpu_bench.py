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
    """Guards against CPU numbers landing in the GPU results file, against a GPU
    script that has never run end to end (it would first fail on the lent GPU), and against
    rows without their peak memory, the budget's prediction for their shape, the budget's
    command, or the layer spec their figures were measured with (issue 39)."""
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
    # Each train/ref/bridge row sits next to the budget's prediction for its shape, under the
    # command that prints that budget (issue 39: peak memory per phase vs the budget).
    head = next(ln for ln in smoke.stdout.splitlines() if ln.startswith("| section |"))
    col = [c.strip() for c in head.split("|")].index("budget_gib")
    assert "peak_gib" in head and "Budget for the smoke rows: `python -m grpo_mega.preflight.budget" in smoke.stdout
    measured = [ln.split("|") for ln in timed if ln.split("|")[1].strip() in ("train", "ref", "bridge")]
    assert len(measured) == 3 and all(r[col].strip() for r in measured), measured
    assert all("local spec, no TE" in r[-2] for r in measured if r[1].strip() in ("train", "ref")), measured


def _bench_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_bench", ROOT / "benchmarks" / "gpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_ready_bench_keeps_every_row_fits_3b_and_labels_fp8_mfu_honestly(tmp_path):
    """Guards against issue 27's defect 9: only OOM was caught and the file written at the
    end, so one TE or NCCL error lost every row (each row must be written as measured and
    an error recorded in its row); the 3B rows OOMed as configured (4 x 2048 tokens: 90 GiB
    by the project's budget; they must fit 80 GB); FP8 "MFU" divided everything by the FP8
    peak although attention and the LM head run in bf16. And the lite smoke's 1B row being
    compared with anything but the sum of its shape's trainer rows in the budget."""
    from grpo_mega.config import load_config
    from grpo_mega.preflight.budget import derive_layout, memory_budget

    gpu = _bench_module()
    path = tmp_path / "bench.md"
    report = gpu.Report("# head\n\n", path)
    report.measure(dict(section="train", case="a"), lambda: {"seconds": 1.0})
    assert "| train | a |" in path.read_text()  # on disk before the next row runs

    def nccl_error():
        raise RuntimeError("NCCL error: unhandled system error")
    report.measure(dict(section="train", case="b"), nccl_error)
    report.measure(dict(section="train", case="c"), lambda: {"seconds": 2.0})
    text = path.read_text()
    assert "error: RuntimeError: NCCL error: unhandled system error" in text and "| train | c |" in text

    fit = gpu.TRAIN_FIT["3b"]
    shape = [f"--model.{k}={v}" for k, v in gpu.MODELS["3b"].items()]
    cfg = load_config(None, shape + [
        "--model.family=llama", "--model.dtype=bfloat16", f"--model.recompute={fit['recompute']}",
        f"--parallel.micro_batch_size={fit['micro_batch']}", "--algorithm.kl_coef=0",
        "--data.prompts_per_step=1", f"--rollout.n={fit['micro_batch']}", "--data.max_prompt_tokens=1024",
        "--rollout.max_new_tokens=1024", "--rollout.max_model_len=2048"])
    assert memory_budget(cfg, derive_layout(cfg, 1)).training_phase_gib < 78

    # The lite smoke's 1B row (micro-batch 1 x 2048): the budget it is compared with is its
    # trainer rows' sum, and fits an H100 with room for the local spec's unfused attention.
    b = gpu.budget_gib(gpu.MODELS["1b"], "bfloat16", 1, 2048)
    parts = ("policy weights", "gradients", "optimizer", "reference weights", "activations", "logits")
    assert b["train"] == sum(b[k] for k in parts) and 20 < b["train"] < 40, b

    m = gpu.MODELS["1b"]
    fp8_part, bf16_part = gpu.train_flops_split(m, 2048)
    assert fp8_part + bf16_part == gpu.train_flops_per_token(m, 2048)
    peak = gpu.mixed_peak(m, 2048, 989.0, 1979.0)
    assert 989.0 < peak < 1979.0 * 0.9  # the LM head and attention hold it well below FP8's


def test_gpu_ready_bench_train_rows_fit_80gb_without_te():
    """Guards against issue 39 finding 8: without Transformer Engine the 1B train rows ran
    megatron's unfused local attention at micro-batch 4, whose kept [mbs, heads, s, s] scores
    (uncounted by the budget) take it past 80 GB; the rows must pick a micro-batch whose
    budget plus those scores fits, and keep micro-batch 4 with TE."""
    gpu = _bench_module()
    seq = 2048
    for name in ("1b", "3b"):
        fit = gpu.train_fit(name, te=False)
        mbs, recompute = fit.get("micro_batch", 4), fit.get("recompute", "none")
        layers = 1 if recompute == "full" else gpu.MODELS[name]["num_layers"]
        scores = gpu.local_attention_gib(dict(gpu.MODELS[name], num_layers=layers), mbs, seq)
        total = gpu.budget_gib(gpu.MODELS[name], "bfloat16", mbs, seq, recompute)["train"] + scores
        assert total < 70, (name, mbs, total)
    assert gpu.train_fit("1b", te=True) == {}  # TE's fused attention: the default micro-batch 4
    at4 = gpu.budget_gib(gpu.MODELS["1b"], "bfloat16", 4, seq)["train"] + gpu.local_attention_gib(gpu.MODELS["1b"], 4, seq)
    assert at4 > 80  # the row the finding saw
