"""Every recipe in ``examples/`` is checked as the trainer's start-up would check it.

Each recipe's header shows its launch commands. Each command is validated by
``docs_commands.check_command``: the recipe YAML and the command's overrides are loaded, the
model shape is taken from the named model's real ``config.json`` (``tests/fixtures/hf_shapes``,
shape only), and the trainer's validation runs at the command's world size. The memory budget
of that layout must fit an 80 GiB GPU.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.docs_commands import REPO, check_command

RECIPES = sorted((REPO / "examples").glob("*.yaml"))


def header_commands(path: Path) -> list[str]:
    """The shell commands in a YAML file's leading comment block (indented lines, with
    backslash continuations joined)."""
    cmds, cur = [], ""
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line[1:]
        if cur:
            cur += " " + text.strip()
        elif text.startswith("   ") and text.strip() and not text.strip().startswith(("#", "(")):
            cur = text.strip()
        else:
            continue
        if cur.endswith("\\"):
            cur = cur[:-1].rstrip()
        else:
            cmds.append(cur)
            cur = ""
    return cmds


def test_there_are_the_four_recipes_the_docs_promise():
    """Guards against a recipe the docs link to going missing."""
    names = {p.name for p in RECIPES}
    assert {"qwen2.5-7b-math-1node.yaml", "llama3-70b-multinode.yaml", "qwen3-30b-a3b-moe.yaml",
            "single-gpu-qwen2.5-0.5b.yaml"} <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_launch_commands_validate_against_the_real_model_shape(recipe):
    """Guards against a recipe that passes against its YAML but fails on the cluster: a layout
    the real checkpoint's heads or experts do not divide, a launch line missing a path that
    start-up requires, a tool argument that does not parse."""
    cmds = header_commands(recipe)
    launches = [c for c in cmds if f"examples/{recipe.name}" in c]
    assert launches, f"{recipe.name}: no launch command naming the recipe in its header"
    for c in cmds:
        check_command(c)


def _recipe_model(recipe: Path) -> str:
    launch = next(c for c in header_commands(recipe) if f"examples/{recipe.name}" in c and "hf_checkpoint" in c)
    return Path(next(a.split("=", 1)[1] for a in launch.split() if a.startswith("--model.hf_checkpoint="))).name


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_yaml_shape_is_the_real_models(recipe):
    """Guards against a recipe whose YAML shape differs from its model's config.json: the
    trainer would build the checkpoint's shape, while ``--check-config`` without
    ``--model.hf_checkpoint`` would validate and budget the YAML's."""
    import dataclasses

    from grpo_mega.config import load_config
    from grpo_mega.preflight.shape import model_shape_from_hf

    yaml_cfg = load_config(str(recipe))
    real = load_config(str(recipe), [f"--model.hf_checkpoint={REPO / 'tests/fixtures/hf_shapes' / _recipe_model(recipe)}"])
    model_shape_from_hf(real)
    real.model.hf_checkpoint = None
    assert dataclasses.asdict(yaml_cfg.model) == dataclasses.asdict(real.model)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_fits_an_80_gib_gpu(recipe):
    """Guards against a recipe whose per-GPU memory estimate exceeds the card it is written for."""
    from grpo_mega.config import load_config
    from grpo_mega.preflight.budget import derive_layout, memory_budget
    from grpo_mega.preflight.shape import model_shape_from_hf

    cfg = load_config(str(recipe), [f"--model.hf_checkpoint={REPO / 'tests/fixtures/hf_shapes' / _recipe_model(recipe)}"])
    model_shape_from_hf(cfg)
    p = cfg.parallel
    world = p.tp * p.pp * max(p.dp, 1)
    budget = memory_budget(cfg, derive_layout(cfg, world), 80.0)
    assert budget.fits, f"{recipe.name}: peak {budget.peak_gib:.1f} GiB does not fit 80 GiB"
