"""The memory budget's training phase, engine awake or asleep (the asleep branch is tied
to the loop in tests/integration/test_memory_phases.py)."""
from __future__ import annotations

import pytest

from grpo_mega.config import load_config
from grpo_mega.preflight.budget import CUDA_GRAPH_POOL_GIB, RUNTIME_RESERVE_GIB, derive_layout, memory_budget
from tests import REPO

CONFIG = str(REPO / "launch" / "configs" / "llama3_70b.yaml")


@pytest.mark.parametrize("sleep", [True, False])
def test_budget_training_phase_holds_the_engine_share_exactly_when_the_engine_stays_awake(sleep):
    """Guards against a budget that leaves an awake engine's memory out of the training
    phase (``rollout.sleep_between_rollouts: false``: vLLM keeps its whole
    ``gpu_memory_utilization`` share, weights and KV cache, through the update), so a config
    that runs out of memory in its first update is reported as fitting; or that charges a
    sleeping engine anyway, or forgets the CUDA-graph pool vLLM's sleep mode keeps (issue 39).
    The training phase is the trainer's rows plus the reserve, plus the engine's share row
    when it stays awake, its graph pool when it sleeps."""
    cfg = load_config(CONFIG, [f"--rollout.sleep_between_rollouts={str(sleep).lower()}"])
    b = memory_budget(cfg, derive_layout(cfg, 64))
    share = b.row("engine share")
    assert share > 1.0  # GiB: the branch is visible
    trainer = sum(r.gib for r in b.trainer)
    expected = trainer + RUNTIME_RESERVE_GIB + (CUDA_GRAPH_POOL_GIB if sleep else share)
    assert b.training_phase_gib == pytest.approx(expected, rel=1e-12)
    assert b.peak_gib >= b.training_phase_gib


def test_budget_of_an_eager_engine_holds_no_cuda_graph_pool_while_asleep():
    """Guards against a budget that charges vLLM's CUDA-graph pool to an engine started with
    ``rollout.enforce_eager: true`` (no graphs are captured): the first thing to flip when a
    GPU run fails would then report less headroom than it gives. Asleep, an eager engine
    holds nothing on the trainer's GPU; a graph-capturing one holds its pool."""
    eager = memory_budget(c := load_config(CONFIG, ["--rollout.enforce_eager=true"]), derive_layout(c, 64))
    graphs = memory_budget(c := load_config(CONFIG, ["--rollout.enforce_eager=false"]), derive_layout(c, 64))
    trainer = sum(r.gib for r in eager.trainer)
    assert eager.training_phase_gib == pytest.approx(trainer + RUNTIME_RESERVE_GIB, rel=1e-12)
    assert graphs.training_phase_gib - eager.training_phase_gib == pytest.approx(CUDA_GRAPH_POOL_GIB, rel=1e-12)
