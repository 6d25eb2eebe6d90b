"""The metrics sink's end products: reward.png's per-stage panel, the progress bar's metrics,
and wandb in offline mode when it is installed."""
from __future__ import annotations

import json

import pytest

from grpo_mega.trainer.metrics import MetricsSink, plot_figure, stage_series

HISTORY = [
    {"step": 0, "eval_accuracy": 0.3},
    {"step": 1, "reward_mean": 0.1, "time/rollout": 0.2, "time/update": 0.07},
    {"step": 2, "reward_mean": 0.2, "time/rollout": 0.3, "time/update": 0.05, "time/checkpoint": 1.5},
    {"step": 3, "reward_mean": 0.4, "time/rollout": 0.1, "time/update": 0.06, "eval_accuracy": 0.5},
]


def test_stage_series_keeps_each_stage_on_its_own_steps():
    """Guards against stage timings plotted against the wrong steps: a stage that ran on some
    steps only (a checkpoint) shifted onto others, or a stage's seconds mixed with another's."""
    series = stage_series(HISTORY)
    assert list(series) == ["rollout", "update", "checkpoint"]
    assert series["rollout"] == ([1, 2, 3], [0.2, 0.3, 0.1])
    assert series["update"] == ([1, 2, 3], [0.07, 0.05, 0.06])
    assert series["checkpoint"] == ([2], [1.5])


def test_reward_png_has_a_panel_of_seconds_per_stage(tmp_path):
    """Guards against the per-stage panel going missing from reward.png or plotting other data
    than the logged ``time/<stage>`` seconds; and against finish() not writing the files."""
    import matplotlib
    matplotlib.use("Agg")

    fig = plot_figure(HISTORY)
    assert len(fig.axes) == 2
    lines = {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in fig.axes[1].lines}
    assert lines == {k: (list(s), list(v)) for k, (s, v) in stage_series(HISTORY).items()}
    sink = MetricsSink(str(tmp_path), tensorboard=False, total_steps=3)
    for row in HISTORY:
        sink.log(row["step"], {k: v for k, v in row.items() if k != "step"}, console=False)
    sink.finish({"steps": 3})
    assert (tmp_path / "reward.png").stat().st_size > 0
    assert json.loads((tmp_path / "summary.json").read_text()) == {"steps": 3}


def test_bar_metrics_show_reward_kl_and_seconds_per_step():
    """Guards against a progress bar whose live metrics are missing or wrong (seconds per
    step not the sum of the stage timers)."""
    from grpo_mega.trainer.stages import bar_metrics

    m = {"reward_mean": 0.25, "kl": 0.0012, "time/rollout": 0.5, "time/update": 0.25, "loss": 3.0}
    assert bar_metrics(m) == {"reward": "0.250", "kl": "0.001", "s/step": "0.75"}
    assert bar_metrics({"eval_accuracy": 0.5})["eval"] == "50.0%"


def test_wandb_offline_run_records_the_metrics(tmp_path, monkeypatch):
    """Guards against the wandb sink failing silently (its errors are caught) or logging
    nothing: in offline mode a run directory with the run's files must appear."""
    pytest.importorskip("wandb", reason="wandb is optional and not installed")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = MetricsSink(str(tmp_path), tensorboard=False, wandb=True, total_steps=2)
    assert sink.wb is not None, "wandb.init failed"
    sink.log(1, {"reward_mean": 0.5}, console=False)
    sink.finish({"steps": 1})
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert runs and any(runs[0].rglob("*.wandb"))
