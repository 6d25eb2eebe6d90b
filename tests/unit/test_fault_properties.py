"""Property-based fault tests: arbitrary config files, CLI overrides, data rows and reward
inputs give a clear error of the part's own class or a valid object, never an exception
from deep inside (a YAML parser error, a TypeError, a KeyError). Example counts are kept
small so the file runs in seconds."""
from __future__ import annotations

import dataclasses
import json
import tempfile
import typing
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests import REPO  # noqa: E402

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
YAMLISH = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.one_of(st.text(max_size=8), st.integers()), inner,
                                                 max_size=3)), max_leaves=8)


def _fields():
    from grpo_mega.config import Config
    return [(sec.name, f.name) for sec in dataclasses.fields(Config)
            for f in dataclasses.fields(sec.default_factory())]


def _conforms(value, tp) -> bool:
    """Is ``value`` of the dataclass field's annotated type?"""
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        return any(_conforms(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if origin is list:
        return isinstance(value, list) and all(_conforms(v, typing.get_args(tp)[0]) for v in value)
    if origin is dict:
        k, v = typing.get_args(tp)
        return isinstance(value, dict) and all(_conforms(a, k) and _conforms(b, v) for a, b in value.items())
    if tp is typing.Any:
        return True
    if tp is float:
        return isinstance(value, float)
    return isinstance(value, tp) and not (tp is int and isinstance(value, bool))


def _check_types(cfg) -> None:
    for sec in dataclasses.fields(cfg):
        section = getattr(cfg, sec.name)
        hints = typing.get_type_hints(type(section))
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            assert _conforms(value, hints[f.name]), f"{sec.name}.{f.name}={value!r} is not {hints[f.name]}"


@FAST
@given(st.lists(st.tuples(st.sampled_from(_fields()), st.text(max_size=16)), max_size=4))
def test_fault_cli_overrides_give_config_error_or_typed_config(pairs):
    """Guards against a CLI value that crashes the loader from inside (``--rollout.stop=[``
    raised yaml's ScannerError) or is stored with the wrong type, and against validation
    crashing on a typed but odd config instead of naming the field."""
    from grpo_mega.config import ConfigError, load_config
    from grpo_mega.preflight.validate import validate

    args = [f"--{sec}.{name}={value}" for (sec, name), value in pairs]
    try:
        cfg = load_config(None, args)
    except ConfigError:
        return
    _check_types(cfg)
    try:
        validate(cfg, None, check_hardware=False)
    except ConfigError:
        pass


def _section_values(section: str):
    """A section's body: its own field names with arbitrary YAML values, so that the values
    reach the coercion instead of stopping at "unknown field"."""
    names = [n for sec, n in _fields() if sec == section]
    return st.dictionaries(st.sampled_from(names), YAMLISH, min_size=1, max_size=3)


SECTIONS = sorted({sec for sec, _ in _fields()})


def _load_yaml(data):
    """load_config of ``data`` written as a YAML file: a typed Config, or None on ConfigError."""
    import yaml

    from grpo_mega.config import ConfigError, load_config

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "c.yaml"
        path.write_text(yaml.safe_dump(data))
        try:
            return load_config(str(path))
        except ConfigError:
            return None


@FAST
@given(st.one_of(YAMLISH, st.dictionaries(st.sampled_from(SECTIONS), YAMLISH, max_size=3)))
@example({1: {}})  # a non-string section key, every run (random draws reach it only sometimes)
@example({"model": {None: 1}})  # and a non-string field key
def test_fault_yaml_config_gives_config_error_or_typed_config(data):
    """Guards against a config file whose top level or section keys are not strings (a
    TypeError from getattr) or whose values are stored untyped."""
    cfg = _load_yaml(data)
    if cfg is not None:
        _check_types(cfg)


@pytest.mark.parametrize("section", SECTIONS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fault_yaml_section_values_give_config_error_or_typed_config(section, data):
    """Guards against a section whose YAML values are stored without coercion (a string
    where an int belongs), in every section: an earlier single test drew field names from
    the first 60 fields, so the data, reward and checkpoint sections almost always stopped
    at "unknown field" before any value was coerced."""
    cfg = _load_yaml({section: data.draw(_section_values(section))})
    if cfg is not None:
        _check_types(cfg)


@pytest.fixture(scope="module")
def tokenizer():
    from grpo_mega.data.tokenizer import load_tokenizer
    return load_tokenizer(REPO / "grpo_mega" / "assets" / "demo_v1" / "hf")


ROW_VALUES = st.one_of(SCALARS, st.lists(st.dictionaries(st.sampled_from(["role", "content"]),
                                                         SCALARS, max_size=2), max_size=2))


@FAST
@given(st.lists(st.one_of(
    st.dictionaries(st.sampled_from(["prompt", "answer", "messages", "other"]), ROW_VALUES, max_size=4)
    .map(json.dumps),
    st.text(max_size=20)), min_size=1, max_size=5))
def test_fault_data_rows_give_data_error_or_usable_prompts(tokenizer, lines):
    """Guards against a row that crashes loading from inside (a non-string prompt or
    message, a bad line) and against an empty prompt or one of no tokens passing loading
    to fail mid-run in the engine."""
    from grpo_mega.data import PromptDataset
    from grpo_mega.data.prompts import DataError

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "rows.jsonl"
        path.write_text("\n".join(line.replace("\n", " ") for line in lines) + "\n")
        try:
            ds = PromptDataset(path, tokenizer, max_prompt_tokens=64)
        except DataError:
            return
    assert len(ds) > 0
    for p in ds.prompts:
        assert p.text.strip() and len(p.token_ids) > 0 and isinstance(p.reference, str)


@FAST
@given(st.text(max_size=40), st.one_of(st.none(), st.text(max_size=12)))
def test_fault_reward_inputs_score_or_fail_as_a_counted_reward_error(completion, reference):
    """Guards against a completion or reference the math reward cannot parse escaping
    the scorer as a raw exception (or a NaN score) instead of a counted failure under
    ``on_error=zero`` and a ``RewardError`` under ``raise``."""
    import math

    from grpo_mega.rewards import RewardScorer, RewardSpec
    from grpo_mega.rewards.scorer import RewardError, RewardSample

    spec = RewardSpec("math", 1.0, {"use_math_verify": False})
    sample = RewardSample(prompt="1+1=", completion=completion, reference=reference)
    result = RewardScorer([spec], num_workers=0, on_error="zero").score([sample])
    assert len(result.scores) == 1 and math.isfinite(result.scores[0])
    assert result.scores[0] in (0.0, 1.0)
    assert result.num_errors == (1 if reference is None else 0)
    strict = RewardScorer([spec], num_workers=0, on_error="raise")
    if reference is None:  # the failure counted above must raise under "raise"
        with pytest.raises(RewardError):
            strict.score([sample])
    else:
        assert strict.score([sample]).scores == result.scores
