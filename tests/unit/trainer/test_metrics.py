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


def test_logging_plot_false_draws_no_png_and_reaches_the_sink(tmp_path):
    """Guards against ``--logging.plot=false`` (the tests' short runs) still importing
    matplotlib and drawing reward.png, or not reaching the sink the trainer opens."""
    from grpo_mega.config import load_config
    from grpo_mega.trainer.metrics import open_sink

    cfg = load_config(None, [f"--logging.run_dir={tmp_path}", "--logging.plot=false",
                             "--logging.tensorboard=false"])
    sink = open_sink(cfg)
    sink.log(1, {"reward_mean": 0.5}, console=False)
    sink.finish({"steps": 1})
    assert not (tmp_path / "reward.png").exists()
    assert json.loads((tmp_path / "summary.json").read_text()) == {"steps": 1}


def test_tensorboard_events_hold_each_step_scalars_under_their_tags(tmp_path):
    """Guards against TensorBoard curves that differ from metrics.jsonl: a scalar under the
    wrong step or value, a metric left out, or a non-number logged (the sink writes one
    event per step with every scalar, read back here with TensorBoard's own reader)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = MetricsSink(str(tmp_path), tensorboard=True, total_steps=3)
    rows = {1: {"reward_mean": 0.125, "time/rollout": 0.75, "skipped": 0, "note": "x"},
            3: {"reward_mean": -2.5, "time/rollout": 0.5, "skipped": 1, "note": "y"}}
    for step, m in rows.items():
        sink.log(step, m, console=False)
    sink.tb.close()  # flushed; finish() would also draw reward.png
    acc = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    got = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    assert got == {k: [(step, float(m[k])) for step, m in rows.items()]
                   for k in ("reward_mean", "time/rollout", "skipped")}


def test_bar_metrics_show_reward_kl_and_seconds_per_step():
    """Guards against a progress bar whose live metrics are missing or wrong (seconds per
    step not the sum of the stage timers)."""
    from grpo_mega.trainer.stages import bar_metrics

    m = {"reward_mean": 0.25, "kl": 0.0012, "time/rollout": 0.5, "time/update": 0.25, "loss": 3.0}
    assert bar_metrics(m) == {"reward": "0.250", "kl": "0.001", "s/step": "0.75"}
    assert bar_metrics({"eval_accuracy": 0.5})["eval"] == "50.0%"


def _wandb_offline_run(run_dir) -> dict:
    """What an offline wandb run under ``run_dir`` wrote to disk, read back from its
    transaction log (``run-<id>.wandb``): {"project", "config", "rows": {step: {key: value}},
    "exit_code" (None when the run was never finished)}.

    Offline wandb (0.31) writes no ``wandb-summary.json`` or ``config.yaml``; the log is the
    only record, the same file ``wandb sync`` uploads, and wandb 0.31 ships no Python reader.
    Its framing is LevelDB's log format (7-byte file header ``:W&B`` + magic + version, then
    32 KiB blocks of records: crc32c u32, length u16, type u8 with 1 full, 2 first, 3
    middle, 4 last); each record is a ``wandb_internal_pb2.Record`` whose schema comes with
    the installed wandb, so only the framing is ours (unchanged since wandb 0.9)."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    runs = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, f"expected one offline run under {run_dir}/wandb, found {runs}"
    buf = runs[0].read_bytes()
    assert buf[:4] == b":W&B", buf[:7]
    out, parts, pos = {"project": None, "config": {}, "rows": {}, "exit_code": None, "kinds": []}, [], 7
    while pos + 7 <= len(buf):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _crc, n, kind = struct.unpack("<IHB", buf[pos:pos + 7])
        if kind == 0:
            break
        parts.append(buf[pos + 7:pos + 7 + n])
        pos += 7 + n
        if kind not in (1, 4):
            continue
        rec = pb.Record()
        rec.ParseFromString(b"".join(parts))
        parts = []
        which = rec.WhichOneof("record_type")
        out["kinds"].append(which)
        if which == "run":
            out["project"] = rec.run.project
            out["config"].update({u.key: json.loads(u.value_json) for u in rec.run.config.update})
        elif which == "config":
            out["config"].update({u.key: json.loads(u.value_json) for u in rec.config.update})
        elif which == "history":
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
            assert row["_step"] == rec.history.step.num, row
            out["rows"].setdefault(row["_step"], {}).update(
                {k: v for k, v in row.items() if not k.startswith("_")})
        elif which == "exit":
            out["exit_code"] = rec.exit.exit_code
    return out


def _in_fresh_process(script: str, tmp_path) -> dict:
    """Run ``script`` (which prints one JSON line last) in a fresh interpreter with wandb
    offline, then stop wandb's service there, so the run's log is complete when it exits.
    A fresh process, not the test's: in a pytest-xdist worker that had run other test
    files, an offline run once lost its history records (every other record was there),
    and wandb keeps process-wide state (its setup singleton, stream wrappers)."""
    import os
    import subprocess
    import sys

    from tests import REPO

    # This checkout first (the subprocess runs elsewhere, where a relative PYTHONPATH would miss it).
    path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true", PYTHONPATH=path)
    code = f"import wandb\n{script}\nwandb.teardown()\n"
    cwd = tmp_path / "cwd"  # not the run dir: a run written to the working directory is a bug
    cwd.mkdir()
    r = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture
def wandb_offline():
    """The real wandb (nothing leaves the machine: the runs are offline)."""
    return pytest.importorskip("wandb", reason="wandb is optional (the `test` extra installs it)")


# A resumed run (from step 4): steps start past 0, so a sink that drops the step (wandb then
# counts from 0) or shifts it is seen; step 6 carries an eval, as the loop logs it.
RESUMED = [(5, {"reward_mean": 0.5, "kl": 0.001, "time/rollout": 0.25, "time/update": 0.125}),
           (6, {"reward_mean": 0.75, "kl": 0.002, "time/rollout": 0.5, "time/update": 0.25,
                "eval_accuracy": 0.625, "ref_reset": 1.0})]


def test_wandb_run_holds_each_step_metrics_config_and_a_clean_exit(tmp_path, wandb_offline):
    """Guards against the wandb sink losing what it was given, read back from the offline run
    real wandb wrote: metrics logged without their step or at another step, a metric key
    dropped or renamed (or the sink's own ``step``/``time`` fields leaking in), the run
    config not handed to ``wandb.init``, a project other than ``grpo-mega``, the run written
    outside ``run_dir``, and ``finish()`` not closing the run (no exit record, or
    ``wandb.run`` still open). Its errors are swallowed by design, so only this sees them."""
    config = {"algorithm": {"steps": 6, "kl_coef": 0.01}, "model": {"hf_checkpoint": "tiny"}}
    out = _in_fresh_process(f"""
import json
from grpo_mega.trainer.metrics import MetricsSink
sink = MetricsSink({str(tmp_path)!r}, tensorboard=False, wandb=True, total_steps=6, config={config!r})
assert sink.wb is not None, "wandb.init failed (see the [metrics] line above)"
for step, m in {RESUMED!r}:
    sink.log(step, dict(m), console=False)
sink.finish({{"steps": 6}})
print(json.dumps({{"run_closed": wandb.run is None}}))""", tmp_path)
    assert out["run_closed"], "the wandb run is still open after finish()"
    run = _wandb_offline_run(tmp_path)
    assert run["rows"] == dict(RESUMED), run["kinds"]
    assert run["project"] == "grpo-mega"
    assert {k: v for k, v in run["config"].items() if k != "_wandb"} == config
    assert run["exit_code"] == 0


def test_open_sink_hands_the_run_config_to_wandb(tmp_path, wandb_offline):
    """Guards against the trainer's sink ignoring ``--logging.wandb`` or giving wandb another
    config than the run's (none, or not the one in ``run_dir/config.json``)."""
    _in_fresh_process(f"""
import json
from grpo_mega.config import Config
from grpo_mega.trainer.metrics import open_sink
cfg = Config()
cfg.logging.run_dir, cfg.logging.wandb, cfg.logging.tensorboard = {str(tmp_path)!r}, True, False
open_sink(cfg).finish({{}})
print(json.dumps({{}}))""", tmp_path)
    run = _wandb_offline_run(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["logging"]["wandb"] is True and written["logging"]["run_dir"] == str(tmp_path)
    assert {k: v for k, v in run["config"].items() if k != "_wandb"} == written
