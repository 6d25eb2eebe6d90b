"""``trainer.preflight``: faults a run can only hit mid-run are refused before any
process group, model or engine exists, each naming its flag or file."""
from __future__ import annotations

import json
import shutil

import pytest
import torch.distributed as dist

from tests import REPO

ASSETS = REPO / "grpo_mega" / "assets" / "demo_v1"
CONFIG = REPO / "grpo_mega" / "configs" / "demo.yaml"


def _cfg(tmp_path, *extra):
    from grpo_mega.config import load_config
    return load_config(str(CONFIG), ["--parallel.tp=1", f"--model.hf_checkpoint={ASSETS / 'hf'}",
                                     f"--data.train_path={ASSETS / 'train.jsonl'}",
                                     f"--data.eval_path={ASSETS / 'eval.jsonl'}",
                                     f"--logging.run_dir={tmp_path / 'run'}", *extra])


def _preflight(cfg):
    from grpo_mega.trainer.trainer import preflight
    try:
        return preflight(cfg, 1)
    finally:
        assert not dist.is_initialized(), "preflight started a process group"


def test_preflight_fault_free_run_passes_and_resume_auto_starts_fresh(tmp_path):
    """Guards against the preflight checks refusing the shipped demo (a false alarm)."""
    pre = _preflight(_cfg(tmp_path))
    assert len(pre.dataset) > 0 and len(pre.eval_set) > 0
    assert pre.resume_from is None and pre.ckpt_dir == tmp_path / "run" / "checkpoints"


def test_fault_empty_prompt_is_refused_naming_the_row(tmp_path):
    """Guards against an empty prompt string passing loading and failing mid-run in the
    engine (or being sampled as a request that asks nothing)."""
    from grpo_mega.data.prompts import DataError

    bad = tmp_path / "train.jsonl"
    rows = (ASSETS / "train.jsonl").read_text().splitlines()[:5]
    bad.write_text("\n".join(rows + [json.dumps({"prompt": "  ", "answer": "1"})]) + "\n")
    with pytest.raises(DataError, match=r"train.jsonl:6.*empty prompt"):
        _preflight(_cfg(tmp_path, f"--data.train_path={bad}"))


def test_fault_tokenizer_larger_than_model_vocab_is_refused(tmp_path):
    """Guards against a tokenizer whose ids exceed the model's vocabulary being accepted
    (the ids past the embedding fail in the first forward, or hit padding rows)."""
    from grpo_mega.config import ConfigError

    hf = tmp_path / "hf"
    shutil.copytree(ASSETS / "hf", hf, ignore=shutil.ignore_patterns("*.safetensors"))
    conf = json.loads((hf / "config.json").read_text())
    conf["vocab_size"] = 12  # the tokenizer has 16
    (hf / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ConfigError, match=r"has 16 tokens but model.vocab_size=12.*--model.hf_checkpoint"):
        _preflight(_cfg(tmp_path, f"--model.hf_checkpoint={hf}"))


def test_fault_resume_must_with_a_mistyped_dir_names_the_folder(tmp_path):
    """Guards against ``--checkpoint.dir`` with a typo silently starting from scratch:
    with ``checkpoint.resume=must`` it is an error naming the folder, before any
    process group or engine starts."""
    from grpo_mega.checkpoint import CheckpointError

    typo = tmp_path / "chekpoints"
    with pytest.raises(CheckpointError, match=f"{typo}.*does not exist.*--checkpoint.dir"):
        _preflight(_cfg(tmp_path, f"--checkpoint.dir={typo}", "--checkpoint.resume=must"))


@pytest.mark.parametrize("flags, needle", [
    (["--checkpoint.resume=always"], "checkpoint.resume='always' is not one of"),
    (["--model.init_checkpoint=/nope/mcore"], "model.init_checkpoint='/nope/mcore'"),
    (["--data.eval_path=/nope.jsonl"], "data.eval_path='/nope.jsonl' does not exist"),
])
def test_fault_bad_flags_fail_in_preflight_naming_the_flag(tmp_path, flags, needle):
    """Guards against an unknown resume mode, a missing init checkpoint or data file
    surfacing after the models are built (or never, for the resume mode)."""
    from grpo_mega.config import ConfigError

    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        _preflight(_cfg(tmp_path, *flags))
