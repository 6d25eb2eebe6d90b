"""Every shipped config fits its card in every phase of a step and in the checkpoint save
(issue 39: the first save ran out of memory where the budget said 15-23 GiB to spare).
No launch: the budget is arithmetic on the config, as ``--check-config`` computes it."""
from __future__ import annotations

import pytest

from grpo_mega.config import load_config
from grpo_mega.preflight.budget import GPU_GIB, GiB, derive_layout, memory_budget
from grpo_mega.preflight.phases import CUDA_GRAPH_POOL_GIB, RUNTIME_RESERVE_GIB, SAVE_GATHER_GIB
from tests import REPO

SHIPPED = sorted((REPO / "launch" / "configs").glob("*.yaml")) + sorted((REPO / "examples").glob("*.yaml"))
PHASES = ["rollout", "reference", "update", "wake-up", "sync", "save"]


def _budget(path, overrides=()):
    cfg = load_config(str(path), list(overrides))
    p = cfg.parallel
    return memory_budget(cfg, derive_layout(cfg, p.tp * p.pp * max(p.dp, 1)))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_shipped_config_fits_its_card_in_every_phase_including_the_save(path):
    """Guards against a shipped config (launch/configs, examples) whose peak in any phase,
    the checkpoint save included, exceeds the card (79.6 GiB, an H100 80GB), or a budget
    that leaves a phase out (the save was 'a transient not counted')."""
    b = _budget(path)
    assert b.gpu_gib == GPU_GIB == 79.6
    assert [ph.name for ph in b.phases] == PHASES
    over = {ph.name: round(ph.gib, 2) for ph in b.phases if not ph.gib <= b.gpu_gib}
    assert not over, f"{path.name}: phases over {b.gpu_gib} GiB: {over}"
    assert b.kv_tokens > 0 and b.peak_gib == max(ph.gib for ph in b.phases)


@pytest.mark.parametrize("sleep", [True, False])
def test_budget_save_and_update_count_the_step_gradients_the_gather_and_the_engine(sleep):
    """Guards against (issue 39) a budget that drops the reduced gradient slice
    (``master.grad``, 4 B/param / dp with the grpo distributed optimizer) from the update,
    the save's accelerator transient (the chunk ``optim/distributed.py`` gathers at a time),
    vLLM's CUDA-graph pool that sleep mode keeps, or an awake engine's share during the save
    (``rollout.sleep_between_rollouts: false``: the engine cannot be released for it)."""
    from grpo_mega.optim.distributed import GATHER_CHUNK_BYTES

    assert SAVE_GATHER_GIB == GATHER_CHUNK_BYTES / GiB
    b = _budget(REPO / "launch" / "configs" / "llama3_8b.yaml",
                [f"--rollout.sleep_between_rollouts={str(sleep).lower()}"])
    # Llama-3-8B, bf16, grpo distributed optimizer over dp 2: 4 of its 12 B/param / dp.
    assert b.row("step gradients") == pytest.approx(b.row("optimizer") / 3, rel=1e-12)
    resident = sum(b.row(n) for n in ("policy weights", "gradients", "optimizer", "reference weights",
                                      "FP8 weight cache"))
    engine = CUDA_GRAPH_POOL_GIB if sleep else b.row("engine share")
    update = resident + b.row("step gradients") + b.row("activations") + b.row("logits")
    assert b.phase("update") == pytest.approx(update + engine + RUNTIME_RESERVE_GIB, rel=1e-12)
    assert b.phase("save") == pytest.approx(resident + SAVE_GATHER_GIB + engine + RUNTIME_RESERVE_GIB, rel=1e-12)
    assert b.host_save_gib == pytest.approx(2 * b.row("optimizer"), rel=1e-12)  # the whole state, on the host
    fp8 = _budget(REPO / "launch" / "configs" / "llama3_8b.yaml", ["--model.fp8=hybrid"])
    assert fp8.row("FP8 weight cache") == pytest.approx(fp8.row("policy weights"), rel=1e-12)  # 2 B/param
    assert fp8.phase("rollout") == pytest.approx(b.phase("rollout") + fp8.row("FP8 weight cache"), rel=1e-12)
