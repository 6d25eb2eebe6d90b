"""Turn a public math/reasoning dataset file into the trainer's prompt JSONL.

What: :func:`prepare` reads JSONL or Parquet files as the datasets are distributed and
writes ``train.jsonl`` and ``eval.jsonl`` rows of ``{"prompt": ..., "answer": ...}`` (or
``{"messages": [...], "answer": ...}``), the shape :class:`~grpo_mega.data.PromptDataset`
reads by default. One converter per source shape, keyed by name in :data:`FORMATS`:

* ``gsm8k``: ``question`` / ``answer``, the answer a worked solution ending in
  ``#### 72``; the reference becomes ``72`` (thousands separators removed, as GSM8K's
  own grader does);
* ``math``: ``problem`` / ``solution``, the final answer in the solution's last
  ``\\boxed{...}`` (nested braces kept: ``\\frac{1}{2}``);
* ``messages``: chat rows, ``messages`` a list of ``{role, content}`` turns. A final
  assistant turn is the worked answer: it is dropped from the prompt (the model must not
  see it) and its ``\\boxed{}`` / ``####`` answer is the reference, unless the row has an
  ``answer`` field, which wins;
* ``auto`` picks one of those per row from its keys.

Why the rules:
* Nothing is dropped silently. A row that cannot be converted is skipped with a reason
  (missing field, no final answer, empty prompt, duplicate prompt, malformed line), and the
  report counts every reason and keeps the first locations of each.
* The held-out split is a pure function of the prompt text and ``seed`` (a hash order),
  not of the row order, so re-running on a reshuffled file gives the same split; a prompt
  that occurs twice is kept once, so it can never sit on both sides of the split.
* Writes are atomic (``*.tmp`` then rename) and never overwrite an earlier output unless
  asked (``overwrite``): a half-written ``train.jsonl`` is never left for a run to read.

Run: ``python tools/prepare_data.py --format gsm8k --input train.jsonl --out data/gsm8k``
(docs/guides/data.md walks one dataset end to end).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

from grpo_mega.data.prompts import DataError, read_rows
from grpo_mega.rewards.math import extract_answer

__all__ = ["FORMATS", "PrepareReport", "Skip", "convert_row", "prepare", "split_key"]

_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")
EXAMPLES_PER_REASON = 5
"""Locations kept per skip reason in the report (the counts are always complete)."""


class Skip(Exception):
    """A row that cannot be converted; ``args[0]`` is the reason (a short, fixed phrase
    so that the report can count rows by reason)."""


def _text(row: dict, key: str) -> str:
    value = row.get(key)
    if value is None:
        raise Skip(f"no '{key}' field")
    if not isinstance(value, str):
        raise Skip(f"'{key}' is not a string")
    if not value.strip():
        raise Skip(f"empty '{key}'")
    return value.strip()


def _gsm8k(row: dict) -> dict:
    question, solution = _text(row, "question"), _text(row, "answer")
    if "####" not in solution:
        raise Skip("no '####' final answer")
    final = solution.rsplit("####", 1)[1].strip()
    if not final:
        raise Skip("no '####' final answer")
    return {"prompt": question, "answer": _THOUSANDS.sub("", final)}


def _math(row: dict) -> dict:
    problem, solution = _text(row, "problem"), _text(row, "solution")
    # never the "last number": in a MATH solution that is often a step, not the answer
    final = extract_answer(solution, allow_last_number=False)
    if not final:
        raise Skip("no \\boxed{} final answer")
    return {"prompt": problem, "answer": final}


def _messages(row: dict) -> dict:
    msgs = row.get("messages")
    if msgs is None:
        raise Skip("no 'messages' field")
    if not isinstance(msgs, list) or not msgs or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in msgs):
        raise Skip("'messages' is not a list of {role, content} turns")
    turns = [{"role": m["role"], "content": m["content"]} for m in msgs]
    worked = turns.pop()["content"] if turns[-1]["role"] == "assistant" else None
    if not turns or turns[-1]["role"] != "user" or not turns[-1]["content"].strip():
        raise Skip("no user turn to answer")
    answer = row.get("answer")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if not (isinstance(answer, str) and answer.strip()):
        answer = extract_answer(worked, allow_last_number=False) if worked else None
    if not answer:
        raise Skip("no answer (no 'answer' field, no final answer in the assistant turn)")
    return {"messages": turns, "answer": answer.strip()}


def _auto(row: dict) -> dict:
    for keys, convert in ((("question", "answer"), _gsm8k), (("problem", "solution"), _math),
                          (("messages",), _messages)):
        if all(k in row for k in keys):
            return convert(row)
    raise Skip("unknown row shape (none of question/answer, problem/solution, messages)")


FORMATS: dict[str, Callable[[dict], dict]] = {
    "auto": _auto, "gsm8k": _gsm8k, "math": _math, "messages": _messages,
}
"""Converters by ``--format`` name: a row in, ``{"prompt"|"messages", "answer"}`` out,
or :class:`Skip` with the reason."""


def convert_row(row: dict, fmt: str, keep: Sequence[str] = ()) -> dict:
    """One source row -> one output row (raises :class:`Skip`); ``keep`` copies those
    source fields through (a metadata field the reward reads, e.g. ``level``)."""
    out = FORMATS[fmt](row)
    for k in keep:
        if k in row and k not in out:
            out[k] = row[k]
    return out


def split_key(out_row: dict, seed: int) -> str:
    """The row's place in the hash order that decides the split: sha256 of the seed and
    the prompt (text or turns), so it depends on neither the row's position nor its answer."""
    prompt = out_row.get("prompt", out_row.get("messages"))
    blob = json.dumps([seed, prompt], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass
class PrepareReport:
    """What :func:`prepare` read, wrote and skipped."""

    read: int = 0
    train: int = 0
    eval: int = 0
    skipped: Counter = field(default_factory=Counter)
    """Rows skipped, by reason."""
    examples: dict = field(default_factory=dict)
    """Reason -> the first locations (``file:line``) skipped for it."""
    outputs: dict = field(default_factory=dict)

    def skip(self, reason: str, where: str) -> None:
        self.skipped[reason] += 1
        self.examples.setdefault(reason, [])
        if len(self.examples[reason]) < EXAMPLES_PER_REASON:
            self.examples[reason].append(where)

    def as_dict(self) -> dict:
        return {"read": self.read, "train": self.train, "eval": self.eval,
                "skipped": dict(self.skipped), "skipped_examples": self.examples,
                "outputs": self.outputs}

    def lines(self) -> list[str]:
        out = [f"read {self.read} rows: {self.train} train, {self.eval} eval, "
               f"{sum(self.skipped.values())} skipped"]
        for reason, n in self.skipped.most_common():
            out.append(f"  skipped {n}: {reason} (first: {', '.join(self.examples[reason])})")
        return out


def _read(path: str) -> Iterator[tuple[str, dict | None]]:
    """``(location, row)`` per row; ``row`` is None for a malformed JSONL line, which is
    counted and skipped instead of ending the file (``read_rows`` stops at the first)."""
    p = Path(path)
    if p.suffix.lower() not in (".jsonl", ".json"):
        for where, _uid, row in read_rows(p):  # Parquet: malformed rows cannot occur
            yield where, row
        return
    if not p.is_file():
        raise DataError(f"input file {str(p)!r} does not exist")
    with p.open("r", encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            yield f"{p}:{lineno}", row if isinstance(row, dict) else None


def _rows(paths: Iterable[str], fmt: str, keep: Sequence[str], report: PrepareReport,
          seen: set, progress: Callable[[str], None]) -> Iterator[dict]:
    for path in paths:
        for where, row in _read(path):
            report.read += 1
            if report.read % 100_000 == 0:
                progress(f"[prepare] {report.read} rows read")
            if row is None:
                report.skip("malformed line (not a JSON object)", where)
                continue
            try:
                out = convert_row(row, fmt, keep)
            except Skip as s:
                report.skip(s.args[0], where)
                continue
            key = split_key(out, 0)
            if key in seen:
                report.skip("duplicate prompt", where)
                continue
            seen.add(key)
            yield out


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def prepare(inputs: Sequence[str], out_dir: str, fmt: str = "auto", *, eval_inputs: Sequence[str] = (),
            eval_fraction: float = 0.05, eval_size: int | None = None, seed: int = 0,
            keep: Sequence[str] = (), overwrite: bool = False,
            progress: Callable[[str], None] = lambda s: print(s, file=sys.stderr)) -> PrepareReport:
    """Convert ``inputs`` into ``out_dir/train.jsonl`` and ``out_dir/eval.jsonl``.

    The eval split is ``eval_inputs`` converted when given (a dataset's own test file;
    a prompt found in both is kept in eval only), else ``eval_size`` rows, else
    ``eval_fraction`` of the rows, taken in :func:`split_key` order. Raises
    :class:`~grpo_mega.data.DataError` on bad arguments or when nothing is left to train on.
    """
    if fmt not in FORMATS:
        raise DataError(f"unknown --format {fmt!r}; choose one of {sorted(FORMATS)}")
    if not 0.0 <= eval_fraction < 1.0 or eval_fraction != eval_fraction:
        raise DataError(f"--eval-fraction must be in [0, 1), got {eval_fraction}")
    if eval_size is not None and eval_size < 0:
        raise DataError(f"--eval-size must be >= 0, got {eval_size}")
    out = Path(out_dir)
    targets = {"train": out / "train.jsonl", "eval": out / "eval.jsonl"}
    existing = [str(p) for p in targets.values() if p.exists()]
    if existing and not overwrite:
        raise DataError(f"{', '.join(existing)} already exist(s); pass --overwrite to replace, "
                        "or choose another --out")
    report, seen = PrepareReport(), set()
    held = list(_rows(eval_inputs, fmt, keep, report, seen, progress))
    rows = list(_rows(inputs, fmt, keep, report, seen, progress))
    if not eval_inputs:
        rows.sort(key=lambda r: split_key(r, seed))
        n_eval = eval_size if eval_size is not None else round(len(rows) * eval_fraction)
        if rows and eval_fraction > 0 and eval_size is None:
            n_eval = max(n_eval, 1)
        held, rows = rows[:n_eval], rows[n_eval:]
    if not rows:
        raise DataError(f"no training rows left from {list(inputs)} ({'; '.join(report.lines())}); "
                        "check --format and the files' fields")
    out.mkdir(parents=True, exist_ok=True)
    _write_jsonl(targets["train"], rows)
    _write_jsonl(targets["eval"], held)
    report.train, report.eval = len(rows), len(held)
    report.outputs = {k: str(v) for k, v in targets.items()}
    (out / "prepare_report.json").write_text(json.dumps(report.as_dict(), indent=1) + "\n")
    return report


def main_args(args: Any) -> int:
    """The CLI's body (``tools/prepare_data.py`` parses, this runs): 0 on success, 2 on a
    data error, which it prints as one line."""
    try:
        report = prepare(args.input, args.out, args.format, eval_inputs=args.eval_input or (),
                         eval_fraction=args.eval_fraction, eval_size=args.eval_size, seed=args.seed,
                         keep=args.keep or (), overwrite=args.overwrite)
    except DataError as e:
        print(f"prepare_data: error: {e}", file=sys.stderr)
        return 2
    print("\n".join(report.lines()))
    print(f"wrote {report.outputs['train']} and {report.outputs['eval']} "
          f"(report: {Path(args.out) / 'prepare_report.json'})")
    print(f"train with: --data.train_path={report.outputs['train']} "
          f"--data.eval_path={report.outputs['eval']}")
    return 0
