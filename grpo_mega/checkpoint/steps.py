"""The checkpoint directory's layout, and the only code that renames or deletes inside it.

A checkpoint directory (``checkpoint.dir``) holds published saves ``step_XXXXXXXX``, the
one being written (``step_XXXXXXXX.tmp``), the pointer file ``latest`` (the name of the
step to resume from) and, for a moment, ``step_X.replaced`` (a published step moved aside
while its replacement goes in) and ``step_X.deleting`` (rotated out, being deleted).
Callers hold the directory's lock (``run_lock``) and call this on global rank 0 only.

What this module guarantees, and against what:

* **Only directories this project wrote are renamed or deleted.** Each gets the marker
  file ``.grpo-mega-checkpoint`` the moment it is created; a ``step_*`` or ``*.tmp``
  without it (another tool's, a hand-made copy, a checkpoint from before the marker) is
  never touched, even when ``checkpoint.dir`` points at a shared directory. The marker is
  deleted last, so a half-deleted directory keeps it and the next save finishes the job.
* **Rotation never loses a new save.** Each save records a sequence number (``save_seq``
  in ``grpo_meta.json``) one above every checkpoint in the directory; ``keep_last`` keeps
  the newest saves by that number, never the save just published nor the one ``latest``
  names. (Rotation by step number deleted every new save right after publishing it once
  the directory held higher steps: after ``checkpoint.resume=never``, or after ``latest``
  was pointed back at an earlier step to recover from a divergence.)
* **A kill at any moment leaves a checkpoint that resume finds.** A save is written under
  ``.tmp`` and renamed into place. Re-publishing a step that exists (re-running a
  finished command) renames the old one to ``step_X.replaced``, the new one into place,
  and only then deletes the old one; a kill in between leaves ``step_X.replaced``, which
  ``latest`` resolves to while ``step_X`` is missing and which the next save moves back.
* **``latest`` names a step of this directory.** A pointer that is not a ``step_*`` name
  (``../x``, an absolute path) or that resolves outside the directory (a symlink out) is
  refused, so a crafted pointer cannot make a resume read another directory.
* ``checkpoint.resume=never`` moves the published steps and ``latest`` into
  ``previous_<time>/`` (itself a checkpoint directory to resume from), so the new run's
  saves neither replace nor rotate away another run's steps.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Optional

from grpo_mega.checkpoint.io import CheckpointError
from grpo_mega.runtime.faults import fault_point

MARKER = ".grpo-mega-checkpoint"
META = "grpo_meta.json"
LATEST = "latest"
_STEP = re.compile(r"step_\d+")
_ASIDE, _TMP, _DELETING = ".replaced", ".tmp", ".deleting"


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def is_ours(d: Path) -> bool:
    """A real directory (not a link) that this project created: it holds the marker."""
    return d.is_dir() and not d.is_symlink() and (d / MARKER).is_file()


def _published(root: Path) -> list[Path]:
    return [d for d in root.glob("step_*") if _STEP.fullmatch(d.name) and is_ours(d) and (d / META).is_file()]


def _remove(d: Path) -> None:
    """Delete one of our directories, its marker last (a kill midway leaves it ours)."""
    for child in d.iterdir():
        if child.name == MARKER:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)
    (d / MARKER).unlink(missing_ok=True)
    try:
        d.rmdir()
    except OSError:
        pass  # something appeared meanwhile: left for a person to look at


def _foreign(path: Path, root: Path) -> CheckpointError:
    return CheckpointError(
        f"{path} exists but was not written by grpo-mega (it has no {MARKER} marker), so it is left "
        f"alone; move it out of {root}, or give this run another --checkpoint.dir")


def recover(root: Path) -> None:
    """Finish what a killed save, re-publish or rotation left behind (our directories only):
    ``*.tmp`` and ``*.deleting`` are deleted; ``step_X.replaced`` goes back to ``step_X``
    when its replacement never arrived, and is deleted when it did."""
    if not root.is_dir():
        return
    for d in sorted(root.iterdir()):
        if not is_ours(d):
            continue
        if d.name.endswith((_TMP, _DELETING)):
            _remove(d)
        elif d.name.endswith(_ASIDE):
            final = d.with_name(d.name[:-len(_ASIDE)])
            if is_ours(final) and (final / META).is_file():
                _remove(d)
            elif not final.exists() and not final.is_symlink():
                os.rename(d, final)


def begin(root: Path, step: int) -> Path:
    """Before a save: clean up after a killed one, check that the names this save will take
    are free or ours, and create the marked, empty ``step_X.tmp``."""
    root.mkdir(parents=True, exist_ok=True)
    recover(root)
    final = root / step_name(step)
    tmp = final.with_name(final.name + _TMP)
    for p in (final, final.with_name(final.name + _ASIDE)):
        if (p.exists() or p.is_symlink()) and not is_ours(p):
            raise _foreign(p, root)
    if tmp.exists() or tmp.is_symlink():
        # An empty one is a save killed between mkdir and the marker: nothing to lose.
        if not (tmp.is_dir() and not tmp.is_symlink() and not any(tmp.iterdir())):
            raise _foreign(tmp, root)
        tmp.rmdir()
    tmp.mkdir()
    (tmp / MARKER).write_text("written by grpo-mega; rotation and clean-up touch only directories holding this file\n")
    return tmp


def next_sequence(root: Path) -> int:
    """One above the newest save in ``root`` (1 in an empty directory)."""
    return 1 + max((_order(d)[0] for d in _published(root)), default=0)


def _order(d: Path) -> tuple[int, int]:
    """(save sequence, step): newer saves sort last. A save without a readable sequence
    sorts before every save that has one."""
    try:
        seq = int(json.loads((d / META).read_text()).get("save_seq", -1))
    except (OSError, ValueError, TypeError, AttributeError):
        seq = -1
    return seq, int(d.name[len("step_"):])


def finish(root: Path, tmp: Path, meta: dict, keep_last: int) -> Path:
    """After every rank has written into ``tmp``: record ``meta`` (with the save's sequence
    number) in its ``grpo_meta.json``, then ``publish``."""
    meta = dict(meta, save_seq=next_sequence(root))
    (tmp / META).write_text(json.dumps(meta, indent=1, default=str))
    return publish(root, tmp, keep_last)


def publish(root: Path, tmp: Path, keep_last: int) -> Path:
    """Rename the finished ``tmp`` into place, point ``latest`` at it, then rotate.
    Every step leaves a complete checkpoint under a name ``latest`` resolves."""
    final = tmp.with_name(tmp.name[:-len(_TMP)])
    aside = final.with_name(final.name + _ASIDE)
    if final.exists() or final.is_symlink():
        if not is_ours(final):
            raise _foreign(final, root)
        os.rename(final, aside)  # free: begin() checked it
        fault_point("checkpoint.republish")  # the old one aside, the new one not yet in place
    os.rename(tmp, final)
    pointer_tmp = root / (LATEST + _TMP)
    pointer_tmp.write_text(final.name + "\n")
    os.replace(pointer_tmp, root / LATEST)
    if is_ours(aside):
        _remove(aside)
    rotate(root, keep_last, keep=final)
    return final


def rotate(root: Path, keep_last: int, keep: Path) -> list[str]:
    """Delete all but the ``keep_last`` newest saves (by save sequence), never ``keep``
    nor the step ``latest`` names; returns the names deleted."""
    if keep_last <= 0:
        return []
    protect = {keep.name, _pointer_name(root)}
    done = sorted(_published(root), key=_order)
    old = [d for d in done[:-keep_last] if d.name not in protect]
    # Renamed first (atomic), then deleted: a kill mid-rotation leaves ``*.deleting``, never
    # a half-deleted ``step_*`` that looks complete; the next save removes it.
    for i, d in enumerate(old):
        gone = d.with_name(d.name + _DELETING)
        os.rename(d, gone)
        if i == 0:
            fault_point("checkpoint.rotate")
        _remove(gone)
    return [d.name for d in old]


def _pointer_name(root: Path) -> Optional[str]:
    try:
        return (root / LATEST).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def resolve_latest(root: Path) -> Optional[Path]:
    """The checkpoint ``latest`` names (or, while a re-publish was cut short, the copy set
    aside for it); None without a ``latest``. Refuses a name that is not a ``step_*``
    directory of ``root``."""
    pointer = root / LATEST
    if not pointer.exists():
        return None
    name = _pointer_name(root)
    fix = f"point 'latest' at a complete step_* directory of {root} or remove it"
    if name is None or not _STEP.fullmatch(name):
        shown = "unreadable bytes" if name is None else repr(name[:80])
        raise CheckpointError(f"{pointer} holds {shown}, not the name of a step_* directory; {fix}")
    for cand in (root / name, root / (name + _ASIDE)):
        if (cand / META).is_file():
            where = cand.resolve()
            if not where.is_relative_to(root.resolve()):
                raise CheckpointError(f"{pointer} names {name}, which resolves to {where}, outside {root}; "
                                      f"a checkpoint is loaded only from its own directory: {fix}")
            return cand
    raise CheckpointError(f"{pointer} names {name}, but {root / name} is missing or incomplete; {fix}")


def set_aside(root: Path) -> Optional[Path]:
    """``checkpoint.resume=never``: move the published steps (ours) and ``latest`` into a
    new ``root/previous_<time>`` and return it (None when there was nothing to move)."""
    if not root.is_dir():
        return None
    recover(root)
    steps = _published(root)
    pointer = root / LATEST
    if not steps:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest = root / f"previous_{stamp}"
    n = 1
    while dest.exists():
        n += 1
        dest = root / f"previous_{stamp}-{n}"
    dest.mkdir()
    for d in steps:
        os.rename(d, dest / d.name)
    if pointer.is_file() and not pointer.is_symlink():
        os.rename(pointer, dest / LATEST)
    return dest
