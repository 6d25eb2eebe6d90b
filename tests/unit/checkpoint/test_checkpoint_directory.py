"""The checkpoint directory under recovery steps and hostile neighbours (issue 38, findings
7, 8 and 10): which saves rotation keeps, what a kill mid-re-publish leaves, whose
directories clean-up touches, where ``latest`` and ``weight_map`` may point, and which
jobs share one checkpoint directory. Each test drives rank 0's real directory code
(``steps.begin`` / ``steps.finish``, exactly what ``save_checkpoint`` runs once the shards
are written) with a tiny shard file, and checks the files left on disk. Loading a real
checkpoint after such a kill is in ``test_checkpoint_faults``."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from grpo_mega.runtime import faults
from grpo_mega.checkpoint import CheckpointError, latest_checkpoint
from grpo_mega.checkpoint import steps


def _save(root: Path, step: int, run: str, keep_last: int = 2) -> Path:
    """One save as rank 0 runs it: begin, the shards (one tiny file here), finish."""
    tmp = steps.begin(root, step)
    (tmp / "__0_0.distcp").write_bytes(f"{run}:{step}".encode())
    return steps.finish(root, tmp, {"step": step, "run": run}, keep_last)


def _on_disk(root: Path) -> dict[str, str]:
    """step directory -> the run that wrote it (from its shard file)."""
    return {d.name: (d / "__0_0.distcp").read_text().split(":")[0]
            for d in sorted(root.glob("step_*")) if (d / "__0_0.distcp").is_file()}


def _latest_run(root: Path) -> tuple[str, str]:
    found = latest_checkpoint(root)
    return found.name, (found / "__0_0.distcp").read_text()


def test_rotation_keeps_the_newest_saves_after_latest_points_back_and_after_resume_never(tmp_path):
    """Guards against ``keep_last`` keeping the highest step *numbers* (issue 38 finding 7):
    after ``latest`` was pointed back at an earlier step (recovery from a divergence), or
    after ``checkpoint.resume=never`` in a directory with higher steps, each new save was
    deleted right after it was published while ``latest`` named it."""
    back = tmp_path / "pointed_back"
    for s in range(1, 9):
        _save(back, s, "old", keep_last=5)
    assert sorted(_on_disk(back)) == [steps.step_name(s) for s in range(4, 9)]
    (back / "latest").write_text("step_00000004\n")  # the user's recovery step
    _save(back, 5, "new", keep_last=2)
    assert _on_disk(back) == {"step_00000005": "new", "step_00000008": "old"}  # the 2 newest saves
    assert _latest_run(back) == ("step_00000005", "new:5")
    _save(back, 6, "new", keep_last=2)
    assert _on_disk(back) == {"step_00000005": "new", "step_00000006": "new"}
    assert _latest_run(back) == ("step_00000006", "new:6")

    fresh = tmp_path / "never"
    for s in range(1, 7):
        _save(fresh, s, "old")
    moved = steps.set_aside(fresh)  # what the trainer does under checkpoint.resume=never
    for s in range(1, 4):
        _save(fresh, s, "new")
        assert _latest_run(fresh) == (steps.step_name(s), f"new:{s}")
    assert _on_disk(fresh) == {"step_00000002": "new", "step_00000003": "new"}
    # the other run's steps survive, with their own pointer, as a directory to resume from
    assert _on_disk(moved) == {"step_00000005": "old", "step_00000006": "old"}
    assert _latest_run(moved) == ("step_00000006", "old:6")
    # without the set-aside too, rotation keeps the new run's saves
    shared = tmp_path / "shared"
    for s in range(5, 9):
        _save(shared, s, "old")
    for s in (1, 2):
        _save(shared, s, "new")
        assert _latest_run(shared) == (steps.step_name(s), f"new:{s}")
    assert _on_disk(shared) == {"step_00000001": "new", "step_00000002": "new"}


def test_republish_killed_between_its_renames_leaves_the_step_that_resume_finds(tmp_path, monkeypatch):
    """Guards against re-publishing a step (a finished command run again) deleting the
    published copy before its replacement is renamed into place (issue 38 finding 8): a
    kill in that window left nothing to resume."""
    root = tmp_path / "ckpt"
    _save(root, 2, "first")
    _save(root, 3, "first")
    monkeypatch.setattr(faults, "_FAULT", faults.parse("checkpoint.republish:raise"))
    with pytest.raises(faults.FaultInjected):  # stands for a kill: nothing after it runs
        _save(root, 3, "again")
    monkeypatch.setattr(faults, "_FAULT", None)
    assert not (root / "step_00000003").exists()  # the window under test
    name, data = _latest_run(root)
    assert data == "first:3", (name, data)  # the published copy, moved aside intact
    _save(root, 4, "again")  # the next save puts it back, then rotates normally
    assert _on_disk(root) == {"step_00000003": "first", "step_00000004": "again"}
    assert not list(root.glob("*.replaced")) and not list(root.glob("*.tmp"))
    # an uninterrupted re-publish replaces the step in place
    _save(root, 4, "third")
    assert _latest_run(root) == ("step_00000004", "third:4")
    assert _on_disk(root) == {"step_00000003": "first", "step_00000004": "third"}


def test_clean_up_and_rotation_touch_only_directories_grpo_mega_wrote(tmp_path):
    """Guards against a ``checkpoint.dir`` pointed at a shared directory losing other
    tools' ``*.tmp`` and ``step_*`` folders to the stale-file clean-up and to rotation
    (issue 38 finding 10): only directories holding the marker are renamed or deleted."""
    root = tmp_path / "shared"
    foreign = {"step_00000005": b"another tool's step", "build.tmp": b"someone's build",
               "step_00000099.tmp": b"a half-copied folder", "step_00000006.deleting": b"theirs"}
    for name, data in foreign.items():
        (root / name).mkdir(parents=True)
        (root / name / "data.bin").write_bytes(data)
    (root / "step_00000005" / "grpo_meta.json").write_text('{"step": 5}')  # looks like ours
    for s in range(1, 5):
        _save(root, s, "mine", keep_last=1)
    for name, data in foreign.items():
        assert (root / name / "data.bin").read_bytes() == data, name
    assert _on_disk(root) == {"step_00000004": "mine"}
    with pytest.raises(CheckpointError, match="step_00000005.*no .grpo-mega-checkpoint marker"):
        steps.begin(root, 5)  # a save would have to replace another tool's folder
    assert (root / "step_00000005" / "data.bin").read_bytes() == foreign["step_00000005"]


def test_latest_and_weight_map_outside_the_checkpoint_directory_are_refused(tmp_path):
    """Guards against ``latest`` and an HF index's ``weight_map`` naming paths outside the
    checkpoint directory (issue 38 finding 10): a crafted pointer or index made a resume
    or an HF load read another directory's files as weights."""
    from grpo_mega.checkpoint.hf_files import HFReader
    from grpo_mega.common.safetensors_io import write_safetensors

    outside = tmp_path / "elsewhere"
    _save(outside, 1, "outsider")
    root = tmp_path / "ckpt"
    _save(root, 1, "mine")
    for pointer in ("../elsewhere/step_00000001", str(outside / "step_00000001")):
        (root / "latest").write_text(pointer + "\n")
        with pytest.raises(CheckpointError, match="not the name of a step_\\* directory"):
            latest_checkpoint(root)
    (root / "step_00000007").symlink_to(outside / "step_00000001")  # a link out, under a step name
    (root / "latest").write_text("step_00000007\n")
    with pytest.raises(CheckpointError, match="outside"):
        latest_checkpoint(root)

    hf = tmp_path / "hf"
    hf.mkdir()
    write_safetensors(str(tmp_path / "secret.safetensors"), [("w", torch.ones(2))], metadata={"format": "pt"})
    for target in ("../secret.safetensors", str(tmp_path / "secret.safetensors")):
        (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": target}}))
        with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
            HFReader(hf)


def test_one_checkpoint_directory_is_locked_whichever_run_directory_holds_it(tmp_path):
    """Guards against two jobs sharing one checkpoint directory (issue 38 finding 10): one
    keeps it inside its run directory, the other points ``--checkpoint.dir`` at it, and
    only the run directories were locked."""
    from grpo_mega.checkpoint.run_lock import RunDirectoryLocked, lock_run

    first = lock_run(tmp_path / "run_a", tmp_path / "run_a" / "checkpoints")
    try:
        with pytest.raises(RunDirectoryLocked, match="checkpoint directory .*run_a/checkpoints"):
            lock_run(tmp_path / "run_b", tmp_path / "run_a" / "checkpoints")
        # the refused job holds nothing: its own run directory is free for the next try
        other = lock_run(tmp_path / "run_b", tmp_path / "run_b" / "checkpoints")
        assert [lk.directory.name for lk in other] == ["run_b", "checkpoints"]
        for lk in other:
            lk.release()
    finally:
        for lk in first:
            lk.release()
    same = lock_run(tmp_path / "run_c", tmp_path / "run_c")  # one directory, locked once
    assert len(same) == 1
    same[0].release()


def test_trainer_claim_under_resume_never_moves_the_old_steps_aside_and_locks_both_directories(tmp_path):
    """Guards against the trainer's start-up (``_claim_run``, rank 0 of a 1-rank world: no
    collective) not moving another run's steps aside under ``checkpoint.resume=never``
    (issue 38 finding 7: the new saves then replaced and rotated them) or not locking the
    checkpoint directory inside the run directory (finding 10)."""
    from types import SimpleNamespace

    from grpo_mega.checkpoint.run_lock import RunDirectoryLocked, lock_run
    from grpo_mega.trainer import trainer

    run, ckpt = tmp_path / "run", tmp_path / "run" / "checkpoints"
    for s in (3, 4):
        _save(ckpt, s, "old")
    ps = SimpleNamespace(rank=0, world_size=1)
    said: list[str] = []
    for mode in ("auto", "never"):
        cfg = SimpleNamespace(logging=SimpleNamespace(run_dir=str(run)), checkpoint=SimpleNamespace(resume=mode))
        locks, found = trainer._claim_run(cfg, ps, ckpt, said.append)
        try:
            with pytest.raises(RunDirectoryLocked):
                lock_run(tmp_path / "other_run", ckpt)
        finally:
            for lk in locks:
                lk.release()
        if mode == "auto":
            assert found == ckpt / "step_00000004" and _on_disk(ckpt) == {"step_00000003": "old", "step_00000004": "old"}
    assert found is None and _on_disk(ckpt) == {} and not (ckpt / "latest").exists()
    (moved,) = ckpt.glob("previous_*")
    assert _on_disk(moved) == {"step_00000003": "old", "step_00000004": "old"}
    assert _latest_run(moved) == ("step_00000004", "old:4") and str(moved) in said[-1]
