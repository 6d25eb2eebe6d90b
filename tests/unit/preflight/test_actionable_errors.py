"""Errors a person can act on (issue 38 finding 14): one line naming the cause and the fix,
printed once, before torchrun starts any rank where the launcher can see it. The launcher
runs are ``--dry-run`` or fail in the pre-check (nothing trains); about 10 s in all."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from grpo_mega.config import ConfigError, load_config
from grpo_mega.data.tokenizer import TokenizerError, load_tokenizer
from grpo_mega.preflight import budget
from tests import REPO

DEMO = REPO / "grpo_mega" / "assets" / "demo_v1"
TORCHRUN_SH = REPO / "launch" / "torchrun.sh"
BAD_YAML = "rollout:\n  n: 4\n  temperature: [1\nalgorithm:\n  steps: 3\n"


@pytest.fixture
def no_tokenizer(tmp_path):
    """A model folder holding config.json (and weights) but no tokenizer files."""
    d = tmp_path / "model"
    d.mkdir()
    shutil.copy(DEMO / "hf" / "config.json", d)
    return d


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("NNODES", "NODE_RANK", "NPROC_PER_NODE", "MASTER_ADDR", "CONFIG", "ENTRY",
                        "WORLD_SIZE", "RANK", "LOCAL_RANK", "SKIP_CONFIG_CHECK")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable, "GRPO_TRACEBACK": "1", **extra}


def test_yaml_syntax_error_is_one_line_naming_file_and_line(tmp_path, capsys):
    """Guards against PyYAML's traceback naming ``<unicode string>`` (load_config,
    --check-config, the budget tool) and the launcher shrinking it to a lone ``^``."""
    p = tmp_path / "bad.yaml"
    p.write_text(BAD_YAML)
    with pytest.raises(ConfigError, match=rf"{p}, line 4, column 10: not valid YAML: expected ',' or ']'"):
        load_config(str(p))
    assert budget.main(["--config", str(p)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{p}, line 4" in err and "<unicode string>" not in err, err


def test_model_folder_without_tokenizer_files_is_refused_naming_folder_and_files(no_tokenizer, capsys):
    """Guards against a model folder without tokenizer files loading a tokenizer of 1 token
    (transformers builds one from config.json alone) that fails later with a misleading
    chat-template error: load_tokenizer and the launcher's pre-check both refuse it."""
    with pytest.raises(TokenizerError, match=rf"{no_tokenizer}.*no tokenizer files.*tokenizer\.json"):
        load_tokenizer(no_tokenizer)
    demo = str(REPO / "grpo_mega/configs/demo.yaml")
    paths = [f"--data.train_path={DEMO / 'train.jsonl'}", f"--data.eval_path={DEMO / 'eval.jsonl'}"]
    assert budget.main(["--config", demo, f"--model.hf_checkpoint={no_tokenizer}", *paths, "--validate-only",
                        "--require-paths"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: model folder") and "tokenizer.model" in err, err


def test_pre_check_checks_data_paths(capsys):
    """Guards against the launcher's pre-check passing a config whose data file is missing
    (each rank then failed with a traceback under torchrun's block, 74 lines at 2 ranks)."""
    base = ["--config", str(REPO / "grpo_mega/configs/demo.yaml"), f"--model.hf_checkpoint={DEMO / 'hf'}",
            "--validate-only"]
    assert budget.main(base + ["--data.train_path=/nope/train.jsonl"]) == 2
    assert "config error: data.train_path='/nope/train.jsonl' does not exist" in capsys.readouterr().err
    assert budget.main(base + ["--require-paths", f"--data.train_path={DEMO / 'train.jsonl'}"]) == 2
    assert "data.eval_path is required" in capsys.readouterr().err
    assert budget.main(base + ["--require-paths", f"--data.train_path={DEMO / 'train.jsonl'}",
                               f"--data.eval_path={DEMO / 'eval.jsonl'}"]) == 0


def test_launcher_passes_the_pre_check_message_through(tmp_path, no_tokenizer):
    """Guards against launch/torchrun.sh reporting every config error as "world size N does
    not fit the config" (and a YAML error as a lone ``^``): a config error is the pre-check's
    own line; only a layout error names the world size. A training run's pre-check also
    refuses a model folder without tokenizer files, before torchrun starts."""
    p = tmp_path / "bad.yaml"
    p.write_text(BAD_YAML)
    r = subprocess.run([str(TORCHRUN_SH), "--dry-run"], cwd=REPO, env=_env(NPROC_PER_NODE="1", CONFIG=str(p)),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr == (f"torchrun.sh: error: {p}, line 4, column 10: not valid YAML: "
                                              "expected ',' or ']', but got ':' (while parsing a flow "
                                              "sequence at line 3, column 16)\n"), r.stderr
    run = [str(TORCHRUN_SH), f"--model.hf_checkpoint={no_tokenizer}", f"--data.train_path={DEMO / 'train.jsonl'}",
           f"--data.eval_path={DEMO / 'eval.jsonl'}"]
    r = subprocess.run(run, cwd=REPO, capture_output=True, text=True, timeout=120,
                       env=_env(NPROC_PER_NODE="2", CONFIG="grpo_mega/configs/demo.yaml", ENTRY="grpo_mega.train"))
    assert r.returncode == 2 and r.stderr.startswith(f"torchrun.sh: error: model folder '{no_tokenizer}'"), r.stderr
    assert "does not fit" not in r.stderr and "[torchrun.sh] node" not in r.stderr


def test_a_start_up_refusal_is_printed_once_without_traceback(tmp_path):
    """Guards against a missing data file printing a traceback on every rank: two ranks of
    ``python -m grpo_mega.train`` (as torchrun starts them) refuse before any process group,
    and only the node's first rank prints, one line, naming the flag."""
    args = [sys.executable, "-m", "grpo_mega.train", "--config", "grpo_mega/configs/demo.yaml",
            f"--model.hf_checkpoint={DEMO / 'hf'}", "--data.train_path=/nope/train.jsonl",
            f"--data.eval_path={DEMO / 'eval.jsonl'}", f"--logging.run_dir={tmp_path}"]
    ranks = [subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2")) for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in ranks]
    assert [p.returncode for p in ranks] == [2, 2], outs
    assert outs[1] == ("", ""), outs[1]
    assert outs[0][1] == ("[grpo] config error: data.train_path='/nope/train.jsonl' does not exist "
                          f"(resolved from {REPO}); give the JSONL or Parquet prompt file "
                          "(--data.train_path=FILE)\n"), outs[0]
