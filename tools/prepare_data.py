"""Turn a math/reasoning dataset file (JSONL or Parquet, as distributed) into the trainer's
prompt JSONL, with a held-out eval split and a report of every row skipped and why.

    python tools/prepare_data.py --format gsm8k --input gsm8k/train.parquet \\
        --eval-input gsm8k/test.parquet --out data/gsm8k
    python tools/prepare_data.py --format math --input math.jsonl --eval-size 500 --out data/math

Formats (``--format``): ``gsm8k`` (question / answer ending ``#### 72``), ``math``
(problem / solution with a ``\\boxed{}`` answer), ``messages`` (chat turns; a final
assistant turn is dropped from the prompt and gives the answer), ``auto`` (per row, by its
keys). The rules and their reasons: ``grpo_mega/data/prepare.py``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from grpo_mega.data.prepare import FORMATS, main_args  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", action="append", required=True, metavar="FILE",
                    help="a .jsonl or .parquet file of the dataset (repeat for several)")
    ap.add_argument("--out", required=True, metavar="DIR",
                    help="where train.jsonl, eval.jsonl and prepare_report.json go")
    ap.add_argument("--format", default="auto", choices=sorted(FORMATS),
                    help="the rows' shape (default: %(default)s, decided per row by its keys)")
    ap.add_argument("--eval-input", action="append", metavar="FILE",
                    help="the dataset's own test file as the eval split (repeat for several); "
                         "without it the split is held out of --input")
    ap.add_argument("--eval-fraction", type=float, default=0.05,
                    help="share of --input held out for eval (default: %(default)s)")
    ap.add_argument("--eval-size", type=int, default=None,
                    help="exact number of rows held out for eval (overrides --eval-fraction)")
    ap.add_argument("--seed", type=int, default=0, help="the split's hash seed (default: %(default)s)")
    ap.add_argument("--keep", action="append", metavar="FIELD",
                    help="copy this source field into each row (e.g. level; the reward's metadata)")
    ap.add_argument("--overwrite", action="store_true", help="replace existing outputs in --out")
    return ap


def main(argv=None) -> int:
    return main_args(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
