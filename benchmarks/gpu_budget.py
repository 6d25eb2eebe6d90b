"""The memory budget a row of ``benchmarks/gpu.py`` is compared with: the project's own
estimate (``grpo_mega.preflight.budget``) for the row's shape, so a GPU run shows where the
budget is right and where it is not (e.g. megatron's local attention, which it does not count)."""
from __future__ import annotations

import contextlib
import io

import torch


def budget_flags(shape: dict, dtype: str, mbs: int, seq: int, recompute: str = "none") -> list[str]:
    """The config flags of a bench row's shape for ``grpo_mega.preflight.budget``: one
    sequence of ``seq`` tokens per micro-batch row, no reference (kl_coef=0)."""
    return [f"--model.{k}={v}" for k, v in shape.items()] + [
        "--model.family=llama", f"--model.dtype={dtype}", f"--model.recompute={recompute}",
        "--model.max_position_embeddings=8192", "--model.make_vocab_size_divisible_by=128",
        f"--parallel.micro_batch_size={mbs}", "--algorithm.kl_coef=0", "--data.prompts_per_step=1",
        f"--rollout.n={mbs}", f"--data.max_prompt_tokens={seq // 2}",
        f"--rollout.max_new_tokens={seq - seq // 2}", f"--rollout.max_model_len={seq}"]


def budget_gib(shape: dict, dtype: str, mbs: int, seq: int, recompute: str = "none") -> dict:
    """The budget's per-GPU rows (GiB) for a bench shape, plus the phases rows are compared
    with: ``train`` (every trainer row), ``ref`` (weights + logits), ``bridge`` (weights x 2)."""
    from grpo_mega.config import load_config
    from grpo_mega.preflight.budget import derive_layout, memory_budget

    try:
        cfg = load_config(None, budget_flags(shape, dtype, mbs, seq, recompute))
        b = memory_budget(cfg, derive_layout(cfg, 1))
    except Exception as e:  # noqa: BLE001 - a budget that cannot be computed must not cost the row
        print(f"[gpu-bench] no budget for this shape: {type(e).__name__}: {e}", flush=True)
        return {}
    rows = {r.name: r.gib for r in b.trainer}
    return dict(rows, train=sum(rows.values()), ref=rows["policy weights"] + rows["logits"],
                bridge=2 * rows["policy weights"])


def budget_text(name: str, shape: dict, mbs: int, seq: int, cuda: bool) -> str:
    """The budget report that ``budget_gib`` compares with, and the command that prints it."""
    from grpo_mega.preflight.budget import main as budget_main
    gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else 80.0
    flags = ["--world-size", "1", "--gpu-memory-gib", f"{gib:.1f}"] + budget_flags(
        shape, "bfloat16" if cuda else "float32", mbs, seq)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            budget_main(flags)
        except Exception as e:  # noqa: BLE001 - recorded in the header; the benchmark runs on
            print(f"budget failed: {type(e).__name__}: {e}")
    return (f"Budget for the {name} rows: `python -m grpo_mega.preflight.budget {' '.join(flags)}`\n\n"
            f"```\n{out.getvalue().strip()}\n```\n\n")
