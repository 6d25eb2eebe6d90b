"""Sphinx extension: the site's figures, drawn at build time from real outputs and the code.

Nothing here is hand-drawn, so a figure cannot drift from what it shows:

* ``demo-reward.svg``: the demo's training reward and held-out accuracy per step, read
  from ``docs/data/demo-run/metrics.jsonl``, the ``metrics.jsonl`` of a real ``make demo``
  run (``docs/data/demo-run/README.md`` says which command and commit made it);
* ``step-stages.svg``: one GRPO step's stages, in order, as ``grpo_mega/train.py``'s module
  docstring lists them (the list the loop's timers use), and the weight sync into vLLM;
* ``memory-budget.svg``: the per-GPU peak of each phase for every shipped config in
  ``launch/configs/``, computed by ``grpo_mega.preflight.budget`` exactly as
  ``--check-config`` computes it, against the card's memory.

They are written into ``docs/_generated/`` (not committed) when the build starts; pages
include them as ``../_generated/<name>.svg``.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1]
REPO = DOCS.parent
OUT = DOCS / "_generated"
DEMO_METRICS = DOCS / "data" / "demo-run" / "metrics.jsonl"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # svg.fonttype none: text stays text (searchable, selectable, and checkable by the tests)
    plt.rcParams.update({"svg.hashsalt": "grpo-mega", "svg.fonttype": "none", "font.size": 10, "axes.spines.top": False,
                         "axes.spines.right": False})
    return plt


def _save(fig, name: str) -> Path:
    path = OUT / name
    fig.savefig(path, format="svg", bbox_inches="tight", metadata={"Date": None})
    return path


def demo_reward(plt) -> Path:
    """Training reward (mean over the step's samples) and held-out accuracy by step."""
    rows = [json.loads(line) for line in DEMO_METRICS.read_text().splitlines() if line.strip()]
    train = [(r["step"], r["reward_mean"]) for r in rows if "reward_mean" in r]
    evals = [(r["step"], r["eval_accuracy"]) for r in rows if "eval_accuracy" in r]
    if not train or not evals:
        raise ValueError(f"{DEMO_METRICS}: no reward_mean or eval_accuracy rows")
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    ax.plot(*zip(*train), color="#4c72b0", lw=1.2, label="training reward (mean of the step's samples)")
    ax.plot(*zip(*evals), "o-", color="#dd8452", lw=1.6, label="held-out accuracy (greedy)")
    ax.set_xlabel("step")
    ax.set_ylim(0, 1)
    ax.set_ylabel("reward / accuracy")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", frameon=False)
    return _save(fig, "demo-reward.svg")


def train_stages() -> list[tuple[str, str]]:
    """``(stage, what it does)`` from grpo_mega/train.py's docstring (continuation lines joined)."""
    doc = (REPO / "grpo_mega" / "train.py").read_text().split('"""')[1]
    stages: list[list[str]] = []
    for line in doc.splitlines():
        m = re.match(r"^  (\S[\w /]*?)\s{2,}(\S.*)$", line)
        if m:
            stages.append([m.group(1).strip(), m.group(2).strip()])
        elif stages and re.match(r"^ {6,}\S", line):
            stages[-1][1] += " " + line.strip()
        elif stages and re.match(r"^  \S", line):  # a stage without a description
            stages.append([line.strip(), ""])
    if len(stages) < 5:
        raise ValueError("grpo_mega/train.py's docstring no longer lists the stages as '  name  what'")
    return [(a, b) for a, b in stages]


def step_stages(plt) -> Path:
    """The stages top to bottom, the engine beside them, the sync arrow into it."""
    import textwrap

    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    stages = train_stages()
    n = len(stages)
    fig, ax = plt.subplots(figsize=(8.4, 0.62 * n + 0.6))
    ax.set_xlim(0, 11)
    ax.set_ylim(-0.6, n)
    ax.axis("off")
    for i, (name, what) in enumerate(stages):
        y = n - 1 - i
        ax.add_patch(FancyBboxPatch((0.2, y + 0.1), 6.9, 0.72, boxstyle="round,pad=0.02",
                                    fc="#eef3fb", ec="#4c72b0"))
        ax.text(0.4, y + 0.46, name, weight="bold", va="center")
        ax.text(2.0, y + 0.46, textwrap.shorten(what, 66, placeholder=" ..."), va="center", fontsize=7.5)
        if i:
            ax.add_patch(FancyArrowPatch((3.3, y + 1.1), (3.3, y + 0.83), arrowstyle="-|>",
                                         mutation_scale=8, color="#555"))
    ax.add_patch(FancyBboxPatch((8.2, n / 2 - 0.8), 2.5, 1.6, boxstyle="round,pad=0.02",
                                fc="#fdf0e6", ec="#dd8452"))
    ax.text(9.45, n / 2, "vLLM engine(s)\nrollout + eval", ha="center", va="center")
    names = [s for s, _ in stages]
    for stage, label, style in (("sync", "weights (verified)", "-|>"), ("rollout", "samples", "<|-")):
        if stage in names:
            y = n - 1 - names.index(stage) + 0.46
            ax.add_patch(FancyArrowPatch((7.1, y), (8.2, n / 2), arrowstyle=style, mutation_scale=10,
                                         color="#dd8452", connectionstyle="arc3,rad=-0.2"))
            ax.text(7.15, y + 0.2, label, fontsize=7, color="#a0522d")
    return _save(fig, "step-stages.svg")


def budget_rows() -> list[tuple[str, object]]:
    """``(config name, Budget)`` for every shipped config, as ``--check-config`` computes it."""
    from grpo_mega.config import load_config
    from grpo_mega.preflight.budget import derive_layout, memory_budget

    rows = []
    for path in sorted((REPO / "launch" / "configs").glob("*.yaml")):
        cfg = load_config(str(path), [])
        p = cfg.parallel
        layout = derive_layout(cfg, p.tp * p.pp * max(p.dp, 1))
        rows.append((path.stem, memory_budget(cfg, layout)))
    return rows


def memory_budget_chart(plt) -> Path:
    rows = budget_rows()
    names = [ph.name for ph in rows[0][1].phases] if rows else []
    colors = ("#4c72b0", "#8172b3", "#55a868", "#dd8452", "#ccb974", "#64b5cd")
    fig, ax = plt.subplots(figsize=(7.0, 3.2))
    width = 0.8 / max(len(names), 1)
    for k, name in enumerate(names):
        xs = [i + (k - (len(names) - 1) / 2) * width for i in range(len(rows))]
        ax.bar(xs, [b.phase(name) for _, b in rows], width, label=name, color=colors[k % len(colors)])
    gpu = rows[0][1].gpu_gib if rows else 80.0
    ax.axhline(gpu, color="#c44e52", lw=1.2, ls="--", label=f"GPU memory ({gpu:g} GiB)")
    ax.set_xticks(range(len(rows)), [name for name, _ in rows])
    ax.set_ylabel("GiB per GPU (worst stage)")
    ax.legend(frameon=False, fontsize=8, ncols=7, loc="upper center", bbox_to_anchor=(0.5, 1.18))
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, "memory-budget.svg")


FIGURES = (demo_reward, step_stages, memory_budget_chart)


def generate() -> list[Path]:
    OUT.mkdir(exist_ok=True)
    plt = _pyplot()
    out = []
    for fn in FIGURES:
        out.append(fn(plt))
        plt.close("all")
    return out


def _on_builder_inited(app) -> None:
    generate()


def setup(app):
    app.connect("builder-inited", _on_builder_inited)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
