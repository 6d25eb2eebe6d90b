"""Config: YAML + CLI overrides, types, and layout validation before any process group."""
from __future__ import annotations

import pytest

import dataclasses

from grpo_mega.config import Config, ConfigError, cli_config, field_docs, load_config
from grpo_mega.preflight.validate import validate


def test_every_field_has_a_docstring():
    """Guards against undocumented knobs: --help must explain every field."""
    for sec in dataclasses.fields(Config):
        cls = type(sec.default_factory())
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"{sec.name}: fields without docstring {missing}"


def test_yaml_then_cli_override_precedence(tmp_path):
    """Guards against overrides that are parsed but silently dropped or mistyped."""
    p = tmp_path / "c.yaml"
    p.write_text("parallel:\n  tp: 2\n  micro_batch_size: 2\nrollout:\n  stop: [\"\\n\"]\n")
    cfg = load_config(str(p), ["--parallel.tp=1", "--algorithm.dual_clip", "3.0",
                               "--rollout.temperature=0.7", "--algorithm.tis_cap=null"])
    assert cfg.parallel.tp == 1 and isinstance(cfg.parallel.tp, int)
    assert cfg.parallel.micro_batch_size == 2
    assert cfg.algorithm.dual_clip == 3.0 and cfg.rollout.temperature == 0.7
    assert cfg.algorithm.tis_cap is None and cfg.rollout.stop == ["\n"]


@pytest.mark.parametrize("args, needle", [
    (["--parallel.tp=two"], "parallel.tp"),
    (["--model.qkv_bias=maybe"], "model.qkv_bias"),
    (["--parallel.nope=1"], "unknown field"),
    (["--nosection.x=1"], "unknown section"),
    (["stray"], "unrecognised argument"),
])
def test_bad_cli_values_name_the_field(args, needle):
    """Guards against a typo becoming a silent default or a crash deep in the run."""
    with pytest.raises(ConfigError, match=needle):
        load_config(None, args)


def test_wrong_type_in_yaml_names_field_and_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("parallel:\n  tp: '2x'\n")
    with pytest.raises(ConfigError, match=r"parallel\.tp.*bad\.yaml"):
        load_config(str(p))


@pytest.mark.parametrize("overrides, world, needle", [
    (["--parallel.tp=3", "--model.num_attention_heads=4"], 3, "num_attention_heads=4 is not divisible by parallel.tp=3"),
    (["--parallel.tp=4", "--model.num_attention_heads=8", "--model.num_query_groups=2"], 4, "num_query_groups=2"),
    (["--parallel.pp=3", "--model.num_layers=4"], 3, "num_layers=4 is not divisible by parallel.pp=3"),
    (["--parallel.tp=2"], 3, "world size 3 is not divisible"),
    (["--parallel.micro_batch_size=3"], 1, "micro_batch_size"),
    (["--data.mini_batch_size=5"], 1, "mini_batch_size"),
    (["--data.prompts_per_step=2", "--rollout.n=8", "--data.mini_batch_size=8", "--parallel.micro_batch_size=1"],
     2, "whole groups of rollout.n=8 samples and split over dp=2"),
    (["--parallel.dp=2"], 1, "parallel.dp=2"),
    (["--algorithm.kl_kind=k9"], 1, "algorithm.kl_kind"),
    (["--rollout.max_model_len=16"], 1, "rollout.max_model_len"),
    (["--algorithm.logits_chunk_size=-1"], 1, "--algorithm.logits_chunk_size"),
])
def test_impossible_layouts_fail_before_distributed_work(overrides, world, needle):
    """Guards against bad layouts that would otherwise hang in a collective on some rank."""
    cfg = load_config(None, overrides)
    with pytest.raises(ConfigError, match=needle):
        validate(cfg, world)


def test_defaults_validate_and_help_lists_fields(capsys):
    validate(Config(), 1)
    with pytest.raises(SystemExit):
        cli_config(["--help"])
    out = capsys.readouterr().out
    assert "--parallel.tp" in out and "Tensor-parallel size" in out


@pytest.mark.parametrize("override, field, value", [
    ("--algorithm.kl_kind=k4", "algorithm.kl_kind", "k4"),
    ("--algorithm.loss_agg=seq-sum", "algorithm.loss_agg", "seq-sum"),
    ("--algorithm.norm=zscore", "algorithm.norm", "zscore"),
    ("--algorithm.baseline=median", "algorithm.baseline", "median"),
    ("--algorithm.advantage=gae", "algorithm.advantage", "gae"),
    ("--algorithm.policy_loss=dapo", "algorithm.policy_loss", "dapo"),
])
def test_unimplemented_variant_names_fail_at_load_listing_the_registry(override, field, value):
    """Guards against config restating the registries by hand: kl_kind=full once passed
    validation and the run died at its first update, since the loss has no 'full'."""
    from grpo_mega import algorithms as A

    known = {"algorithm.kl_kind": A.KL_ESTIMATORS, "algorithm.loss_agg": A.AGGREGATIONS,
             "algorithm.norm": A.NORMS, "algorithm.baseline": A.BASELINES,
             "algorithm.advantage": A.ADVANTAGE_ESTIMATORS,
             "algorithm.policy_loss": A.POLICY_LOSSES}[field]
    cfg = load_config(None, [override])
    with pytest.raises(ConfigError) as err:
        validate(cfg, 1, check_hardware=False)
    msg = str(err.value)
    assert f"{field}={value!r}" in msg and f"(--{field})" in msg, msg
    assert all(repr(name) in msg for name in known.names()), msg


def test_kl_aliases_are_valid_config_names():
    """Guards against validation listing only canonical names, refusing the aliases
    (mse, low_var_kl) that the loss accepts."""
    for kind in ("mse", "low_var_kl", "k1", "abs"):
        validate(load_config(None, [f"--algorithm.kl_kind={kind}"]), 1, check_hardware=False)


def test_full_kl_is_accepted_at_every_layout():
    """Guards against validation refusing kl_kind=full on a layout the schedule carries it
    through (PP>1 sends the reference's hidden states with the policy's; the update is
    checked against PP=1 in tests/unit/trainer/test_full_kl_pp.py)."""
    for flags, world in (([], 1), (["--parallel.tp=2"], 4), (["--parallel.pp=2"], 2),
                         (["--parallel.tp=2", "--parallel.pp=2"], 4)):
        validate(load_config(None, ["--algorithm.kl_kind=full", *flags]), world, check_hardware=False)

def test_process_advantage_is_accepted_but_not_with_dynamic_sampling():
    """Guards against process supervision refused at load although the loop runs it, and
    against DAPO's per-sample filter dropping groups that still carry step-level signal."""
    validate(load_config(None, ["--algorithm.advantage=process"]), 1, check_hardware=False)
    cfg = load_config(None, ["--algorithm.advantage=process", "--algorithm.dynamic_sampling=true"])
    with pytest.raises(ConfigError, match="dynamic_sampling.*--algorithm.dynamic_sampling=false"):
        validate(cfg, 1, check_hardware=False)


def test_unknown_reward_function_fails_at_load_listing_the_registry():
    """Guards against a typo in reward.functions surviving until the first scoring."""
    from grpo_mega.rewards import REWARD_REGISTRY

    cfg = load_config(None, ["--reward.functions=[maths]"])
    with pytest.raises(ConfigError) as err:
        validate(cfg, 1, check_hardware=False)
    msg = str(err.value)
    assert "reward.functions" in msg and "'maths'" in msg and "--reward.functions" in msg, msg
    assert all(repr(name) in msg for name in REWARD_REGISTRY), msg


def test_registering_a_kl_estimator_makes_it_valid_in_config():
    """Guards against a second, hand-kept list of names: registering a variant must be
    the only edit needed for config to accept it (and removing it refuses it again)."""
    from grpo_mega import algorithms as A

    cfg = load_config(None, ["--algorithm.kl_kind=test_half_sq"])
    with pytest.raises(ConfigError, match="algorithm.kl_kind"):
        validate(cfg, 1, check_hardware=False)
    A.KL_ESTIMATORS.register("test_half_sq")(lambda x: 0.5 * x * x)
    try:
        validate(cfg, 1, check_hardware=False)
    finally:
        A.KL_ESTIMATORS.unregister("test_half_sq")
    with pytest.raises(ConfigError, match="algorithm.kl_kind"):
        validate(cfg, 1, check_hardware=False)


@pytest.mark.parametrize("overrides, needles", [
    (["--reward.functions=[no_such_mod:f]"], ["'no_such_mod:f'", "cannot import module", "--reward.functions"]),
    (["--reward.functions=[tests.unit.rewards.test_rewards:nope]"], ["has no callable 'nope'", "--reward.functions"]),
    (["--reward.kwargs={format: {reward: 2}}"], ["reward.kwargs", "'format'", "does not list", "--reward.kwargs"]),
    (["--reward.kwargs={math: {corect: 2}}"], ["reward 'math'", "unexpected keyword argument 'corect'",
                                               "--reward.kwargs"]),
    (["--reward.functions=[math, dapo_overlong]"], ["reward 'dapo_overlong'", "missing a required argument: "
                                                    "'max_length'", "(--reward.kwargs)"]),
    (["--reward.weights=[1, 2]"], ["reward.weights has 2 entries for 1", "--reward.weights"]),
    (["--reward.functions=[math, math]"], ["twice", "--reward.functions"]),
])
def test_bad_reward_config_fails_at_load_naming_the_flag(overrides, needles):
    """Guards against reward mistakes surviving until the first scoring, after the engine
    started: kwargs the function does not take (the overlong penalty once got none and
    raised TypeError on every sample), kwargs for an unlisted function, a module:function
    path that does not import."""
    from grpo_mega.rewards import REWARD_REGISTRY

    cfg = load_config(None, overrides)
    with pytest.raises(ConfigError) as err:
        validate(cfg, 1, check_hardware=False)
    msg = str(err.value)
    assert all(n in msg for n in needles), msg
    if "--reward.functions" in needles[-1] and "twice" not in needles[0]:  # a bad name lists the known ones
        assert all(repr(name) in msg for name in REWARD_REGISTRY), msg


def test_reward_kwargs_parse_from_yaml_and_cli(tmp_path):
    """Guards against the kwargs mapping being read as a string, keys being mistyped, or a
    module:function key being split at its colon."""
    p = tmp_path / "r.yaml"
    p.write_text("reward:\n  functions: [math, dapo_overlong]\n"
                 "  kwargs:\n    dapo_overlong: {max_length: 16, buffer: 4}\n")
    cfg = validate(load_config(str(p)), 1, check_hardware=False)
    assert cfg.reward.kwargs == {"dapo_overlong": {"max_length": 16, "buffer": 4}}
    cli = load_config(None, ['--reward.functions=["tests.unit.rewards.test_rewards:weighted_echo"]',
                             '--reward.kwargs={"tests.unit.rewards.test_rewards:weighted_echo": {scale: 2.5}}'])
    assert validate(cli, 1, check_hardware=False).reward.kwargs == {
        "tests.unit.rewards.test_rewards:weighted_echo": {"scale": 2.5}}
    with pytest.raises(ConfigError, match=r"reward.kwargs.*expected a mapping"):
        load_config(None, ["--reward.kwargs=[1, 2]"])


def test_bad_reward_name_stops_the_cli_before_any_engine_starts():
    """Guards against validation running after the process groups or the vLLM engine are
    up: `python -m grpo_mega.train` with a misspelt reward must exit nonzero with the
    message, without starting anything."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "GRPO_TRACEBACK": "0", "PYTHONPATH": str(root)}
    start = time.monotonic()
    assets = root / "grpo_mega/assets/demo_v1"
    proc = subprocess.run([sys.executable, "-m", "grpo_mega.train", f"--model.hf_checkpoint={assets / 'hf'}",
                           f"--data.train_path={assets / 'train.jsonl'}",
                           f"--data.eval_path={assets / 'eval.jsonl'}", "--reward.functions=[maths]"], cwd=root, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "reward.functions: 'maths' is not a registered reward" in proc.stderr, proc.stderr
    assert "--reward.functions" in proc.stderr and "'math'" in proc.stderr
    assert "world " not in proc.stdout and "vLLM" not in proc.stdout, proc.stdout
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("overrides, flag", [
    (["--rollout.top_p=0.9"], "rollout.top_p=0.9"),
    (["--rollout.top_k=20"], "rollout.top_k=20"),
])
def test_tis_with_truncated_sampling_is_refused_naming_both_flags(overrides, flag):
    """Guards against a biased TIS weight: with top-p/top-k the engine's log-probs are of
    the truncated distribution, the trainer's of the full softmax(logits / T), so
    exp(old - rollout) is off on every token. Off-policy updates (ppo_epochs > 1,
    several mini-batches) compare the trainer with itself and stay allowed."""
    cfg = load_config(None, overrides + ["--algorithm.tis_cap=2.0"])
    with pytest.raises(ConfigError) as err:
        validate(cfg, 1, check_hardware=False)
    msg = str(err.value)
    assert flag in msg and "algorithm.tis_cap=2.0" in msg and "--algorithm.tis_cap=null" in msg, msg
    validate(load_config(None, overrides + ["--algorithm.ppo_epochs=2", "--data.mini_batch_size=32"]), 1,
             check_hardware=False)
    for untruncated in (["--rollout.top_k=0"], ["--rollout.top_p=1.0", "--rollout.temperature=0.7"]):
        validate(load_config(None, untruncated + ["--algorithm.tis_cap=2.0"]), 1, check_hardware=False)
    with pytest.raises(ConfigError, match=r"rollout.top_p=0.0 must be in \(0, 1\]"):
        validate(load_config(None, ["--rollout.top_p=0"]), 1, check_hardware=False)


@pytest.mark.parametrize("overrides, needle", [
    (["--algorithm.ref_reset_every=-1"], r"ref_reset_every=-1 must be >= 0"),
    (["--algorithm.ref_reset_every=3", "--algorithm.kl_coef=0"], r"kl_coef=0 builds none"),
])
def test_ref_reset_without_a_reference_is_refused(overrides, needle):
    """Guards against ``ref_reset_every`` being accepted and silently doing nothing: with
    kl_coef=0 the trainer builds no reference, so there is nothing to reset."""
    with pytest.raises(ConfigError, match=needle):
        validate(load_config(None, overrides), 1)
    validate(load_config(None, ["--algorithm.ref_reset_every=3", "--algorithm.kl_coef=0.01"]), 1)
