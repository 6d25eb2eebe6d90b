"""The config's rule for numbers (issue 38 finding 13): every float field finite, no count,
size or time limit negative, greedy sampling refused for a group; each error names its flag.
Cheap: config objects only, nothing started."""
from __future__ import annotations

import dataclasses
import typing

import pytest

from grpo_mega.config import SIGNED_FIELDS, Config, ConfigError, load_config
from grpo_mega.preflight.validate import validate


def _fields(kind) -> list[str]:
    """``section.key`` of every field whose annotation holds ``kind`` (Optional, list)."""
    out = []
    for sec in dataclasses.fields(Config):
        for name, tp in typing.get_type_hints(type(sec.default_factory())).items():
            if kind in (tp, *typing.get_args(tp)):
                out.append(f"{sec.name}.{name}")
    return out


FLOATS = _fields(float)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("key", FLOATS)
def test_every_float_field_refuses_nan_and_infinity_naming_its_flag(key, value):
    """Guards against NaN passing every ``<``/``>`` check: optimizer.lr, rollout.temperature,
    algorithm.kl_coef, clip_low, tis_cap and dual_clip took NaN and the run trained on it.
    One rule covers every float field (this list is read from the dataclasses, so a new
    field is covered too), including those whose null means off."""
    cfg = load_config(None, [f"--{key}={value}" if key != "reward.weights" else f"--{key}=[{value}]"])
    with pytest.raises(ConfigError) as err:
        validate(cfg, 1, check_hardware=False)
    assert f"(--{key})" in str(err.value) and "finite" in str(err.value), str(err.value)


def test_nan_in_yaml_names_the_flag_and_null_stays_off(tmp_path):
    """Guards against the YAML spelling (.nan) escaping the rule, and against the rule
    refusing null, which means "off" for tis_cap and dual_clip."""
    p = tmp_path / "c.yaml"
    p.write_text("algorithm:\n  clip_low: .nan\n")
    with pytest.raises(ConfigError, match=r"algorithm\.clip_low=nan .*\(--algorithm\.clip_low\)"):
        validate(load_config(str(p)), 1, check_hardware=False)
    cfg = validate(load_config(None, ["--algorithm.tis_cap=null", "--algorithm.dual_clip=null"]), 1,
                   check_hardware=False)
    assert cfg.algorithm.tis_cap is None and cfg.algorithm.dual_clip is None


@pytest.mark.parametrize("key, value", [
    ("reward.num_workers", "-1"), ("algorithm.time_limit_minutes", "-5"), ("data.eval_every", "-1"),
    ("checkpoint.keep_last", "-2"), ("reward.timeout_seconds", "-1"), ("parallel.timeout_minutes", "0"),
])
def test_negative_counts_and_time_limits_are_refused_naming_the_flag(key, value):
    """Guards against reward.num_workers=-1 (accepted, then a crash at the first reward)
    and a negative time limit (accepted, then the run stopped at once)."""
    with pytest.raises(ConfigError, match=rf"{key}={value}.* \(--{key}\)"):
        validate(load_config(None, [f"--{key}={value}"]), 1, check_hardware=False)


def test_the_signed_fields_keep_their_meaning():
    """Guards against the non-negative rule refusing top_k=-1 (off) or a negative reward
    weight (a penalty term), the only numbers allowed below 0; top_k below -1 is refused."""
    assert SIGNED_FIELDS == {"rollout.top_k", "reward.weights"}
    validate(load_config(None, ["--rollout.top_k=-1", "--reward.functions=[math,format]",
                                "--reward.weights=[1.0,-0.5]"]), 1, check_hardware=False)
    with pytest.raises(ConfigError, match=r"rollout.top_k=-2 .*\(--rollout.top_k\)"):
        validate(load_config(None, ["--rollout.top_k=-2"]), 1, check_hardware=False)


def test_greedy_sampling_of_a_group_is_refused():
    """Guards against rollout.temperature=0 with n > 1: the group's completions are
    identical, every advantage is 0, and the run learns nothing while reporting steps."""
    with pytest.raises(ConfigError, match=r"rollout.temperature=0 .*--rollout.temperature"):
        validate(load_config(None, ["--rollout.temperature=0", "--rollout.n=4"]), 1, check_hardware=False)
    validate(load_config(None, ["--rollout.temperature=0.01", "--rollout.n=4"]), 1, check_hardware=False)
