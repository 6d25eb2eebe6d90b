"""tools/prepare_data.py: public dataset shapes -> the trainer's prompt JSONL.

Each test writes a small file in the shape the dataset is distributed in, converts it, and
reads the output back with the trainer's own reader (``read_rows``) and dataset."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from grpo_mega.data import PromptDataset, read_rows
from grpo_mega.data.prepare import prepare
from grpo_mega.rewards.math import answers_equivalent

REPO = Path(__file__).resolve().parents[3]

GSM8K = [
    {"question": "Natalia sold 48 clips in April and half as many in May. How many in all?",
     "answer": "In May she sold 48/2 = <<48/2=24>>24.\nIn all 48+24 = <<48+24=72>>72.\n#### 72"},
    {"question": "A house costs $1,200 and a car $800. Total?",
     "answer": "1,200 + 800 = 2,000\n#### 2,000"},
    {"question": "No final answer here?", "answer": "It is 5."},
    {"question": "Natalia sold 48 clips in April and half as many in May. How many in all?",
     "answer": "#### 72"},
]


def _jsonl(path: Path, rows: list, extra_lines: tuple = ()) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "".join(extra_lines))
    return path


def _read(path: Path) -> list[dict]:
    return [row for _where, _uid, row in read_rows(path)]


def test_gsm8k_final_answers_and_every_skip_is_reported_with_its_reason(tmp_path):
    """Bugs: the worked solution (or its calculator annotations) kept as the reference, so
    the math reward never matches; the thousands separator kept ("2,000"); rows without a
    final answer or duplicated, or a malformed line, dropped without a word (or ending the
    whole file)."""
    src = _jsonl(tmp_path / "gsm8k.jsonl", GSM8K, extra_lines=("{not json\n",))
    report = prepare([str(src)], str(tmp_path / "out"), "gsm8k", eval_size=0)
    rows = _read(tmp_path / "out" / "train.jsonl")
    assert [(r["prompt"][:8], r["answer"]) for r in rows] in (
        [("Natalia ", "72"), ("A house ", "2000")], [("A house ", "2000"), ("Natalia ", "72")])
    assert report.read == 5 and report.train == 2 and report.eval == 0
    assert dict(report.skipped) == {"no '####' final answer": 1, "duplicate prompt": 1,
                                    "malformed line (not a JSON object)": 1}
    assert report.examples["no '####' final answer"] == [f"{src}:3"]
    assert report.examples["malformed line (not a JSON object)"] == [f"{src}:5"]
    saved = json.loads((tmp_path / "out" / "prepare_report.json").read_text())
    assert saved["skipped"] == dict(report.skipped)


def test_math_parquet_boxed_answer_with_nested_braces(tmp_path):
    """Bugs: the boxed answer cut at its first closing brace ("\\frac{1"), or the last
    number of the solution taken when there is no boxed answer (a step, not the answer)."""
    table = pa.Table.from_pylist([
        {"problem": "Compute 1/2 as a fraction.", "solution": "It is $\\boxed{\\frac{1}{2}}$.",
         "level": "Level 1"},
        {"problem": "What is 3 + 4?", "solution": "3 + 4 = 7, so 7 it is.", "level": "Level 1"},
    ])
    pq.write_table(table, tmp_path / "math.parquet")
    report = prepare([str(tmp_path / "math.parquet")], str(tmp_path / "out"), "math",
                     eval_size=0, keep=["level"])
    rows = _read(tmp_path / "out" / "train.jsonl")
    assert rows == [{"prompt": "Compute 1/2 as a fraction.", "answer": "\\frac{1}{2}",
                     "level": "Level 1"}]
    assert dict(report.skipped) == {"no \\boxed{} final answer": 1}
    assert answers_equivalent("0.5", rows[0]["answer"])


def test_chat_rows_drop_the_worked_assistant_turn_and_take_its_answer(tmp_path, chat_tokenizers):
    """Bug: the final assistant turn (the worked solution) left in the prompt, so the model
    reads the answer it is asked for; or a row's own ``answer`` field ignored."""
    src = _jsonl(tmp_path / "chat.jsonl", [
        {"messages": [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "What is 2 + 3?"},
                      {"role": "assistant", "content": "2 + 3 = 5. \\boxed{5}"}]},
        {"messages": [{"role": "user", "content": "What is 6 * 7?"}], "answer": 42},
        {"messages": [{"role": "user", "content": "Say hi."},
                      {"role": "assistant", "content": "hi"}]},
    ])
    report = prepare([str(src)], str(tmp_path / "out"), "auto", eval_size=0)
    rows = _read(tmp_path / "out" / "train.jsonl")
    by_q = {r["messages"][-1]["content"]: r for r in rows}
    assert by_q["What is 2 + 3?"] == {"messages": [{"role": "system", "content": "Be brief."},
                                                   {"role": "user", "content": "What is 2 + 3?"}],
                                      "answer": "5"}
    assert by_q["What is 6 * 7?"]["answer"] == "42"
    assert report.skipped["no answer (no 'answer' field, no final answer in the assistant turn)"] == 1
    ds = PromptDataset(str(tmp_path / "out" / "train.jsonl"), chat_tokenizers["chatml"], shuffle=False)
    assert all(p.text.rstrip().endswith("assistant") and "\\boxed" not in p.text for p in ds)


def test_held_out_split_is_disjoint_stable_under_reordering_and_readable_by_the_trainer(
        tmp_path, chat_tokenizers):
    """Bugs: a split by row position (a reshuffled copy of the file moves rows between
    train and eval, so eval scores leak), an empty eval split, or output the trainer's
    dataset cannot read."""
    rows = [{"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"} for i in range(40)]
    a = _jsonl(tmp_path / "a.jsonl", rows)
    b = _jsonl(tmp_path / "b.jsonl", rows[::-1])
    prepare([str(a)], str(tmp_path / "A"), "gsm8k", eval_fraction=0.25)
    prepare([str(b)], str(tmp_path / "B"), "gsm8k", eval_fraction=0.25)
    ev = {r["prompt"] for r in _read(tmp_path / "A" / "eval.jsonl")}
    tr = {r["prompt"] for r in _read(tmp_path / "A" / "train.jsonl")}
    assert len(ev) == 10 and len(tr) == 30 and not ev & tr
    assert ev == {r["prompt"] for r in _read(tmp_path / "B" / "eval.jsonl")}

    ds = PromptDataset(str(tmp_path / "A" / "train.jsonl"), chat_tokenizers["chatml"])
    assert len(ds) == 30 and {p.reference for p in ds} <= {str(2 * i) for i in range(40)}


def test_an_eval_file_wins_over_train_for_a_shared_prompt_and_outputs_are_never_overwritten(tmp_path):
    """Bugs: a prompt in both the dataset's train and test files trained on and evaluated
    on; a second run silently overwriting an earlier output."""
    train = _jsonl(tmp_path / "train.jsonl", GSM8K[:2])
    test = _jsonl(tmp_path / "test.jsonl", GSM8K[1:2])
    report = prepare([str(train)], str(tmp_path / "out"), "gsm8k", eval_inputs=[str(test)])
    assert (report.train, report.eval, report.skipped["duplicate prompt"]) == (1, 1, 1)
    assert _read(tmp_path / "out" / "eval.jsonl")[0]["answer"] == "2000"
    before = (tmp_path / "out" / "train.jsonl").read_bytes()
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "prepare_data.py"), "--format", "gsm8k",
                           "--input", str(test), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "--overwrite" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert (tmp_path / "out" / "train.jsonl").read_bytes() == before


@pytest.mark.parametrize("kwargs,flag", [({"fmt": "alpaca"}, "--format"),
                                         ({"eval_fraction": float("nan")}, "--eval-fraction"),
                                         ({"eval_size": -1}, "--eval-size")])
def test_bad_arguments_are_refused_naming_the_flag(tmp_path, kwargs, flag):
    """Bug: a NaN eval fraction (every comparison false) or a negative size accepted."""
    from grpo_mega.data import DataError
    src = _jsonl(tmp_path / "g.jsonl", GSM8K[:2])
    with pytest.raises(DataError, match=flag):
        prepare([str(src)], str(tmp_path / "out"), **kwargs)
