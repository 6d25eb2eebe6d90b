"""The embedded demo (``make demo``): GRPO that visibly learns, on a laptop CPU.

1. takes the packaged tiny Qwen2 + tokenizer + arithmetic data (or rebuilds them);
2. converts the HF checkpoint to a megatron-core checkpoint with
   ``tools/convert_checkpoint.py``, as a user would with a real model;
3. runs ``torchrun --nproc-per-node 2 -m grpo_mega.train`` at TP=2 over gloo with
   vLLM rollouts, a KL-regularised reference model and checkpoints;
4. prints the held-out accuracy before and after (also in ``summary.json``).

``--moe`` runs the mixture-of-experts variant instead: a tiny Qwen3-MoE (4 experts, top-2)
on the same task, TP=1 x DP=2 with expert parallelism EP=2 (``grpo_mega/configs/demo_moe.yaml``,
run directory ``runs/demo_moe``).

``--tools`` runs the multi-turn, tool-using variant: two-digit multiplication with a
``calculator`` tool, episodes of two turns (call, then answer), TP=2
(``grpo_mega/configs/demo_tools.yaml``, ``grpo_mega/demo/tools.py``, run directory
``runs/demo_tools``).

``--lora`` runs the default demo (same task, TP=2) with low-rank adapters on the actor
(rank 8, alpha 16 on every linear, lr 5e-4): the base stays frozen and, with the adapters
off, is the KL reference (run directory ``runs/demo_lora``; docs/guides/lora.md).

Extra arguments are passed to the trainer, e.g. ``--algorithm.steps=50``.
Re-running resumes from the run directory's latest checkpoint; ``--fresh`` starts over.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from grpo_mega.demo.assets import ensure_demo_assets, say

PACKAGE = Path(__file__).resolve().parent.parent  # grpo_mega/
REPO = PACKAGE.parent  # tools/ lives at the top of the checkout
CONFIG = PACKAGE / "configs" / "demo.yaml"
CONFIG_MOE = PACKAGE / "configs" / "demo_moe.yaml"
CONFIG_TOOLS = PACKAGE / "configs" / "demo_tools.yaml"
# --lora: demo.yaml plus these (the user's own flags come after, so they win). LoRA moves
# only the adapters, from B = 0, so it needs a larger step than full fine-tuning's 5e-5.
LORA_OVERRIDES = ["--model.lora.rank=8", "--model.lora.alpha=16", "--optimizer.lr=5.0e-4"]


def demo_env(argv: list[str]) -> dict:
    """The trainer's environment. Quiet by default; with ``make demo ARGS=--verbose`` (or
    ``--logging.verbose=true``) the libraries' output, Python warnings included, is shown,
    so the demo must not silence it here."""
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    if not ("--verbose" in argv or "--logging.verbose=true" in argv):
        # torch reads these when it loads, before the trainer's own quieting can act
        env.setdefault("PYTHONWARNINGS", "ignore")
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    return env


def main(argv: list[str]) -> int:
    fresh, moe, tools, lora = "--fresh" in argv, "--moe" in argv, "--tools" in argv, "--lora" in argv
    if moe + tools + lora > 1:
        say("--moe, --tools and --lora are separate demos; pick one")
        return 2
    argv = [a for a in argv if a not in ("--fresh", "--moe", "--tools", "--lora")]
    run_dir = Path(next((a.split("=", 1)[1] for a in argv if a.startswith("--logging.run_dir=")),
                        "runs/demo_moe" if moe else "runs/demo_tools" if tools
                        else "runs/demo_lora" if lora else "runs/demo"))
    if fresh:
        shutil.rmtree(run_dir, ignore_errors=True)
    if tools:
        from grpo_mega.demo.tools import ensure_tools_assets
        assets = ensure_tools_assets()
    else:
        assets = ensure_demo_assets(variant="moe" if moe else "dense")
    mcore = run_dir / "init_mcore"
    env = demo_env(argv)
    if not mcore.exists():
        say(f"converting the HF checkpoint to megatron-core: {mcore}")
        subprocess.run([sys.executable, str(REPO / "tools" / "convert_checkpoint.py"), "hf-to-mcore",
                        "--hf-dir", str(assets / "hf"), "--out", str(mcore)], check=True, env=env)
    layout = ("TP=1 x DP=2 with expert parallelism EP=2 (a tiny Qwen3-MoE, 4 experts, top-2)"
              if moe else "TP=2, multi-turn episodes with a calculator tool" if tools
              else "TP=2, LoRA adapters on a frozen base" if lora else "TP=2")
    model = ("TP=1 x DP=2, EP=2 mixture-of-experts" if moe
             else "TP=2 (LoRA: adapters only, base frozen)" if lora else "TP=2")
    say(f"launching GRPO: torchrun, 2 ranks, {layout} over gloo, vLLM rollouts, KL to a reference "
        "model (per-step lines below; held-out accuracy every 20 steps)")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--standalone", "-m", "grpo_mega.train", "--config",
           str(CONFIG_MOE if moe else CONFIG_TOOLS if tools else CONFIG),
           f"--model.hf_checkpoint={assets / 'hf'}", f"--model.init_checkpoint={mcore}",
           f"--data.train_path={assets / 'train.jsonl'}", f"--data.eval_path={assets / 'eval.jsonl'}",
           f"--logging.run_dir={run_dir}", *(LORA_OVERRIDES if lora else []), *argv]
    rc = subprocess.run(cmd, env=env).returncode
    summary_file = run_dir / "summary.json"
    if rc != 0 or not summary_file.exists():
        say(f"training failed (exit code {rc}); see the messages above")
        return rc or 1
    s = json.loads(summary_file.read_text())
    gain = (s["eval_accuracy_final"] - s["eval_accuracy_initial"]) * 100
    flag = "--moe" if moe else "--tools" if tools else "--lora" if lora else ""
    again = f"make demo ARGS={flag}" if flag else "make demo"
    fresh_cmd = f'make demo ARGS="{flag} --fresh"' if flag else "make demo ARGS=--fresh"
    print(f"""
[demo] what just happened
  - GRPO sampled 8 {"episodes (a calculator call, the tool's result, an answer)" if tools else "answers"}
    per prompt from vLLM, scored them by exact match, turned the scores into group-relative advantages, and updated a {model} megatron model with the clipped
    surrogate minus a KL penalty; after every step the new weights went back into vLLM.
  - held-out greedy accuracy: {s['eval_accuracy_initial']:.1%} -> {s['eval_accuracy_final']:.1%}
    ({gain:+.1f} points) in {s['steps']} steps, {s['wall_seconds']:.0f} s of training
  - run directory {run_dir}: metrics.jsonl, tensorboard/, reward.png, summary.json, checkpoints/,
    hf/ (the trained model as a Hugging Face directory, for transformers or vLLM)
  - run `{again}` again to resume from the last checkpoint, or `{fresh_cmd}`
""", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
