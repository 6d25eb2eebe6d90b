"""Run the catalogue of bugs the suite must catch (tests/mutations.yaml).

Each entry names a file, an exact change (``search`` -> ``replace``, which must occur
exactly once) and the pytest ids that must fail with it. For every selected entry this
script copies the working tree (tracked and untracked, not ignored files) to a scratch
directory once, applies the change there, runs the entry's tests with ``PYTHONPATH``
pointing at the copy, restores the file, and reports:

* ``CAUGHT``: every listed test id failed (or errored) at least once;
* ``MISSED``: some listed id passed: the suite does not catch that bug;
* ``ERROR``: the change no longer applies (the code moved on: update the entry), pytest
  could not run (collection error, unknown id), or the tests timed out.

The repository itself is never modified. Not part of ``make test``: each entry launches
its own tests, multi-rank ones included (minutes per entry on 2 cores).

Run from the repository root with the project's Python:
    python tools/mutations.py --list
    python tools/mutations.py --only clip-coef-squared,nan-weight-dp2
    python tools/mutations.py                 # the whole catalogue (slow)
    make mutations ARGS="--only clip-coef-squared"
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
CATALOGUE = ROOT / "tests" / "mutations.yaml"
_FIELDS = {"id", "file", "search", "replace", "tests", "source", "why", "timeout"}


@dataclasses.dataclass
class Mutation:
    id: str
    file: str
    search: str
    replace: str
    tests: list
    source: str = ""
    why: str = ""
    timeout: int = 1800


def load(path: Path = CATALOGUE) -> list[Mutation]:
    """The catalogue's entries, checked: known fields, unique ids, tests listed."""
    raw = yaml.safe_load(path.read_text())
    out, seen = [], set()
    for i, e in enumerate(raw.get("mutations") or []):
        unknown = set(e) - _FIELDS
        if unknown:
            raise SystemExit(f"{path}: entry {i} ({e.get('id')}): unknown fields {sorted(unknown)}")
        m = Mutation(**e)
        if m.id in seen:
            raise SystemExit(f"{path}: duplicate id {m.id!r}")
        if not m.tests or m.search == m.replace:
            raise SystemExit(f"{path}: {m.id}: needs 'tests' and a change (search != replace)")
        seen.add(m.id)
        out.append(m)
    return out


def scratch_copy(dest: Path, root: Path = ROOT) -> None:
    """``root``'s tracked and untracked (not ignored) files, copied to ``dest``."""
    files = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=root,
                           check=True, capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = root / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


_RESULT = re.compile(r"^(FAILED|ERROR) (\S+)", re.M)


def run_one(m: Mutation, tree: Path, python: str) -> tuple[str, str, float]:
    """Apply ``m`` in ``tree``, run its tests, restore. Returns (verdict, detail, seconds)."""
    target = tree / m.file
    if not target.is_file():
        return "ERROR", f"{m.file} does not exist", 0.0
    original = target.read_text()
    n = original.count(m.search)
    if n != 1:
        return "ERROR", f"the search text occurs {n} times in {m.file} (must be once)", 0.0
    target.write_text(original.replace(m.search, m.replace))
    # The scratch tree first; the caller's own PYTHONPATH after it (packages installed outside
    # the venv stay importable, and the tree's modules still win over a checkout's).
    path = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    cmd = [python, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *m.tests]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=m.timeout,
                              start_new_session=True)
    except subprocess.TimeoutExpired:
        return "ERROR", f"timed out after {m.timeout} s", time.monotonic() - t0
    finally:
        target.write_text(original)
    dt = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    failed = {nodeid for _, nodeid in _RESULT.findall(out)}
    if proc.returncode == 0:
        return "MISSED", "all its tests passed", dt
    if proc.returncode != 1:
        tail = " | ".join(out.strip().splitlines()[-3:])
        return "ERROR", f"pytest exit {proc.returncode}: {tail}", dt
    if not failed:  # exit 1 with no failing test: e.g. pytest missing from --python's env
        tail = " | ".join(out.strip().splitlines()[-3:])
        return "ERROR", f"pytest exit 1 but no test failed (is {python} the project's venv?): {tail}", dt
    # Every listed id (a node id, or a file / test-function prefix of parametrized ids) must fail.
    passed = [t for t in m.tests if not any(f == t or f.startswith(t + "[") or f.startswith(t + "::")
                                            for f in failed)]
    if passed:
        return "MISSED", f"these passed: {passed} (failed: {sorted(failed)})", dt
    return "CAUGHT", f"{len(failed)} failed", dt


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="print the entries and exit")
    ap.add_argument("--only", default="", help="comma-separated ids to run (default: all)")
    ap.add_argument("--catalogue", default=str(CATALOGUE), help="the YAML file (default: %(default)s)")
    ap.add_argument("--python", default=sys.executable, help="interpreter that runs pytest")
    ap.add_argument("--keep", action="store_true", help="keep the scratch copy (its path is printed)")
    ap.add_argument("--root", default=str(ROOT),
                    help="working tree to copy and mutate (default: this one; another checkout shows "
                         "whether its tests caught an entry, e.g. before a fix)")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    entries = load(Path(args.catalogue))
    if args.only:
        wanted = [s.strip() for s in args.only.split(",") if s.strip()]
        unknown = sorted(set(wanted) - {m.id for m in entries})
        if unknown:
            raise SystemExit(f"--only: unknown ids {unknown} (see --list)")
        entries = [m for m in entries if m.id in wanted]
    if args.list:
        for m in entries:
            print(f"{m.id:40s} {m.file}  -> {' '.join(m.tests)}  [{m.source}]")
        print(f"{len(entries)} entries")
        return 0

    t0 = time.monotonic()
    tree = Path(tempfile.mkdtemp(prefix="grpo-mutations-"))
    counts = {"CAUGHT": 0, "MISSED": 0, "ERROR": 0}
    try:
        scratch_copy(tree, Path(args.root))
        for i, m in enumerate(entries, 1):
            verdict, detail, dt = run_one(m, tree, args.python)
            counts[verdict] += 1
            print(f"[{i}/{len(entries)}] {verdict:6s} {m.id} ({dt:.0f} s): {detail}", flush=True)
    finally:
        if args.keep:
            print(f"scratch copy kept at {tree}")
        else:
            shutil.rmtree(tree, ignore_errors=True)
    wall = time.monotonic() - t0
    print(f"mutations: {counts['CAUGHT']} caught, {counts['MISSED']} missed, {counts['ERROR']} errors "
          f"of {len(entries)} in {wall:.0f} s")
    return 0 if counts["CAUGHT"] == len(entries) else 1


if __name__ == "__main__":
    sys.exit(main())
