"""Start-up refusals and ``--check-config`` against the shape the trainer really builds.

``--check-config`` must refuse exactly what the trainer refuses, and the trainer replaces the
YAML's model shape with the checkpoint's ``config.json``; the fixtures in
``tests/fixtures/hf_shapes`` hold real models' shapes (no weights)."""
from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from grpo_mega.config import ConfigError, load_config
from grpo_mega.preflight.validate import validate

REPO = Path(__file__).resolve().parents[3]
QWEN7B = REPO / "tests/fixtures/hf_shapes/Qwen2.5-7B-Instruct"
LLAMA8B = str(REPO / "launch/configs/llama3_8b.yaml")


def _budget(argv):
    from grpo_mega.preflight.budget import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def test_check_config_validates_the_checkpoint_shape_not_the_yaml():
    """Guards against ``--check-config`` validating the YAML's shape: Llama-3-8B's YAML (32
    heads) reused for Qwen2.5-7B (28 heads) passed at TP 8 and failed on the cluster after
    the queue wait. With ``model.hf_checkpoint`` given, the checkpoint's 28 heads are
    checked, and the output names the shape and the file it came from."""
    rc, _, err = _budget(["--config", LLAMA8B, f"--model.hf_checkpoint={QWEN7B}", "--parallel.tp=8",
                          "--rollout.tp=8", "--parallel.dp=1", "--world-size", "8", "--validate-only"])
    assert rc == 2 and "num_attention_heads=28" in err, err
    rc, out, err = _budget(["--config", LLAMA8B, f"--model.hf_checkpoint={QWEN7B}", "--world-size", "8"])
    assert rc == 0, err
    assert f"shape validated: qwen2: 28 layers, hidden 3584, 28 heads / 4 KV groups" in out
    assert str(QWEN7B / "config.json") in out
    assert "7.6" in out.split("model:")[1].split("\n")[0]  # parameters of Qwen2.5-7B, not 8.03B


def test_check_config_says_when_it_validated_the_yaml_shape():
    """Guards against a check that silently validated the YAML's shape: without
    ``model.hf_checkpoint`` the output says so."""
    rc, out, _ = _budget(["--config", LLAMA8B, "--validate-only"])
    assert rc == 0 and "from the config (model.hf_checkpoint not given)" in out
    # what the tool's help (and the CLI reference generated from it) promises
    from grpo_mega.preflight import budget
    assert "--validate-only`` (validate, print two lines" in budget.__doc__
    assert [ln.split(":")[0] for ln in out.strip().splitlines()] == ["shape validated", "ok"], out


def test_megatron_optimizer_with_moe_is_refused_at_start_up():
    """Guards against ``optimizer.distributed_impl=megatron`` with an MoE model passing
    preflight and ``--check-config`` and failing only after the models are built."""
    moe = ["--model.family=qwen3_moe", "--model.num_experts=4", "--model.moe_ffn_hidden_size=128",
           "--parallel.ep=2"]
    validate(load_config(None, moe), 2, check_hardware=False)  # the MoE model itself is fine
    cfg = load_config(None, [*moe, "--optimizer.use_distributed_optimizer=true",
                             "--optimizer.distributed_impl=megatron"])
    with pytest.raises(ConfigError, match=r"distributed_impl=megatron supports dense models only.*"
                                          r"--optimizer.distributed_impl=grpo"):
        validate(cfg, 2, check_hardware=False)


def test_group_of_one_is_refused_naming_the_flag():
    """Guards against ``rollout.n=1``: every sample is its own group's mean, so every
    advantage is 0 and the run trains nothing, silently."""
    with pytest.raises(ConfigError, match=r"rollout.n=1.*--rollout.n"):
        validate(load_config(None, ["--rollout.n=1"]), 1, check_hardware=False)
    validate(load_config(None, ["--rollout.n=2"]), 1, check_hardware=False)


def test_eval_path_is_required_even_without_periodic_evaluation(tmp_path):
    """Guards against a run started with ``data.eval_every=0`` and no ``data.eval_path``
    failing with an unexplained 'does not exist': the run evaluates before step 1 and after
    the last step, so the file is required, and the error says why."""
    from grpo_mega.trainer.trainer import preflight

    demo = REPO / "grpo_mega/assets/demo_v1"
    cfg = load_config(str(REPO / "grpo_mega/configs/demo.yaml"),
                      [f"--model.hf_checkpoint={demo / 'hf'}", f"--data.train_path={demo / 'train.jsonl'}",
                       "--data.eval_every=0", "--parallel.tp=1", f"--logging.run_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"data.eval_path is required, also with data.eval_every=0"):
        preflight(cfg, 1)


def test_demo_verbose_keeps_python_warnings(monkeypatch):
    """Guards against ``make demo ARGS=--verbose`` still hiding Python warnings: the demo set
    ``PYTHONWARNINGS=ignore`` for the trainer whatever the flags."""
    from grpo_mega.demo.__main__ import demo_env

    monkeypatch.delenv("PYTHONWARNINGS", raising=False)
    assert demo_env([])["PYTHONWARNINGS"] == "ignore"
    assert "PYTHONWARNINGS" not in demo_env(["--verbose"])
    assert "PYTHONWARNINGS" not in demo_env(["--logging.verbose=true"])


@pytest.mark.parametrize("flags,needle", [
    (["--env.name=calculatr"], "--env.name"),
    (["--env.name=calculator", "--env.kwargs={max_turn: 2}"], "max_turn"),
    (["--env.name=calculator", "--algorithm.advantage=process"], "--algorithm.advantage=outcome"),
])
def test_multi_turn_env_mistakes_are_refused_at_start_up_naming_the_flag(flags, needle):
    """Guards against a misspelt environment or kwarg (or process supervision, which has
    no per-step scores in episodes) surfacing only after the models and the engine are
    built: validation refuses it and names the flag that fixes it."""
    cfg = load_config(str(REPO / "grpo_mega/configs/demo_tools.yaml"), flags)
    with pytest.raises(ConfigError, match=needle.replace("{", r"\{")):
        validate(cfg, 2)
    validate(load_config(str(REPO / "grpo_mega/configs/demo_tools.yaml")), 2)
