"""RoPE scaling (linear, llama3, yarn) from an HF config.json into megatron and back.

Tiny Llama models with scaled RoPE are built locally with transformers; the megatron
model built from their config.json must compute transformers' logits. The sequences
are longer than the tiny models' original_max_position_embeddings (16), so ignoring
or mis-scaling any frequency moves the logits far past the tolerance (each case also
checks that its unscaled twin differs by more than 1e-2).

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/models/test_rope_scaling.py
"""
from __future__ import annotations

import json

import pytest
import torch

from grpo_mega.models.hf_config import hf_config_from_model_config, model_config_from_hf
from grpo_mega.models.rope import RopeScalingError, llama3_inv_freq
from tests.distributed import run_ranks
from tests.scripts.bridge_fixtures import write_hf_checkpoint

SEQ = 48  # three times the original context below
CASES = {
    # non-Llama-3.1 values on purpose: megatron's own llama3 path hard-codes 1 / 4 / 8192
    "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.5, "high_freq_factor": 6.0,
               "original_max_position_embeddings": 16},
    "linear": {"rope_type": "linear", "factor": 3.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "yarn_mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                    "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 1.2, "mscale_all_dim": 0.4},
}


# ============================================================================ logits vs transformers

def _logits_checks(rank: int, world: int, dirs: dict) -> dict:
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from grpo_mega.checkpoint import convert
    from grpo_mega.distributed.state import init_parallel
    from grpo_mega.models import build_model, forward_logits

    ps = init_parallel(1, 1, seed=3)
    out = {}
    for name, d in dirs.items():
        cfg = convert.read_model_config(d)
        model = build_model(cfg, ps)
        convert.load_hf_weights(model, d, ps, cfg)
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        plain_cfg = json.loads((d / "config.json").read_text())
        plain_cfg.pop("rope_parameters", None)
        plain_cfg.pop("rope_scaling", None)
        plain = LlamaForCausalLM(LlamaConfig(**plain_cfg)).eval()
        plain.load_state_dict(hf.state_dict())
        tokens = torch.randint(0, cfg.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            ours = forward_logits(model, tokens)[..., :cfg.vocab_size]
            want = hf(tokens).logits
            out[name] = {"diff": float((ours - want).abs().max()),
                         "scaling_matters": float((plain(tokens).logits - want).abs().max())}
    return out


@pytest.fixture(scope="module")
def logits_report(tmp_path_factory):
    root = tmp_path_factory.mktemp("rope")
    dirs = {name: write_hf_checkpoint(root / name, "llama", tie=False, seed=i, std=0.1,
                                      max_position_embeddings=64, rope_scaling=rs)
            for i, (name, rs) in enumerate(CASES.items())}
    return run_ranks(1, _logits_checks, dirs, timeout=600)[0]


@pytest.mark.parametrize("case", list(CASES))
def test_scaled_rope_logits_match_transformers(logits_report, case):
    """Guards against rope_scaling being ignored (the Llama-3.1 bug: it loads and computes
    wrong logits), megatron's hard-coded llama3 low/high factors and 8192 context, a
    wrong linear factor, and a dropped or mis-derived YaRN attention factor (mscale)."""
    r = logits_report[case]
    assert r["scaling_matters"] > 1e-2, r  # the sequence is long enough to tell
    assert r["diff"] <= 1e-4, r


# ============================================================================ pure parts

@pytest.mark.parametrize("factor,low,high,original", [(8.0, 1.0, 4.0, 8192), (32.0, 1.0, 4.0, 8192),
                                                      (4.0, 1.5, 6.0, 16), (2.0, 2.0, 3.0, 64)])
def test_llama3_inv_freq_matches_transformers(factor, low, high, original):
    """Guards against a wrong llama3 band (low/high swapped, blend reversed, factor
    applied to the short wavelengths) for Llama-3.1/3.2 values and others."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rp = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
          "original_max_position_embeddings": original, "rope_theta": 500000.0}
    config = LlamaConfig(hidden_size=1024, num_attention_heads=8, rope_parameters=rp)
    want, attention = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    dim = 128
    base = 1.0 / (500000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    got = llama3_inv_freq(base, factor, low, high, original)
    assert attention == 1.0
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert not torch.allclose(base, want)  # the case scales something


def _hub_style(rope_scaling: dict, **extra) -> dict:
    """A config.json as the hub ships Llama-3.1 (transformers 4: top-level rope_theta)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300,
            "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 192, "hidden_act": "silu",
            "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 500000.0,
            "rope_scaling": rope_scaling, **extra}


def _transformers5_style(rope_scaling: dict) -> dict:
    from transformers import LlamaConfig

    return LlamaConfig(**_hub_style(rope_scaling)).to_dict()  # rope_parameters, no rope_theta


@pytest.mark.parametrize("style", ["hub", "transformers5"])
@pytest.mark.parametrize("case", list(CASES))
def test_hf_config_round_trip_keeps_rope_scaling(case, style):
    """Guards against rope_scaling read but not written back (an exported or converted
    checkpoint, and the vLLM engine loading it, would run unscaled RoPE) or written in
    a form transformers reads differently: HF -> ModelConfig -> HF gives transformers the
    same rope parameters."""
    from transformers import LlamaConfig

    src = _hub_style(dict(CASES[case])) if style == "hub" else _transformers5_style(dict(CASES[case]))
    cfg = model_config_from_hf(src)
    assert cfg.rope_scaling == CASES[case]["rope_type"] and cfg.rope_theta == 500000.0
    back = hf_config_from_model_config(cfg)
    json.dumps(back)  # it is written as config.json
    want = LlamaConfig(**_hub_style(dict(CASES[case]))).rope_parameters
    assert LlamaConfig(**back).rope_parameters == want


def test_unscaled_config_has_no_rope_scaling():
    """Guards against a spurious rope_scaling entry (or lost rope_theta) for plain RoPE."""
    from transformers import LlamaConfig

    src = LlamaConfig(**{**_hub_style({}), "rope_scaling": None}).to_dict()
    cfg = model_config_from_hf(src)
    assert cfg.rope_scaling == "none" and cfg.rope_theta == 500000.0
    back = hf_config_from_model_config(cfg)
    assert "rope_scaling" not in back and back["rope_theta"] == 500000.0


@pytest.mark.parametrize("rope_scaling,words", [
    ({"rope_type": "dynamic", "factor": 2.0}, ["'dynamic'"]),
    ({"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}, ["'longrope'"]),
    ({"rope_type": "yarn", "factor": 4.0, "attention_factor": 0.8}, ["attention_factor"]),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}, ["high_freq_factor"]),
    ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}, ["partial_rotary_factor"]),
])
def test_unsupported_rope_scaling_is_refused_naming_type_and_file(tmp_path, rope_scaling, words):
    """Guards against a RoPE variant we cannot reproduce loading silently with other
    logits: the error names the offending key or type and the config.json it came from."""
    from grpo_mega.checkpoint import convert

    (tmp_path / "config.json").write_text(json.dumps(_hub_style(rope_scaling)))
    with pytest.raises(RopeScalingError) as err:
        convert.read_model_config(tmp_path)
    for w in words + [str(tmp_path / "config.json")]:
        assert w in str(err.value), str(err.value)


def test_trainer_takes_rope_scaling_from_the_checkpoint(tmp_path):
    """Guards against the trainer copying the shape from config.json but not the RoPE
    scaling (it would build unscaled actor/reference models next to a scaled vLLM)."""
    from grpo_mega.config import Config
    from grpo_mega.preflight.shape import model_shape_from_hf

    (tmp_path / "config.json").write_text(json.dumps(_hub_style(dict(CASES["yarn_mscale"]))))
    cfg = Config()
    cfg.model.hf_checkpoint = str(tmp_path)
    model_shape_from_hf(cfg)
    m = cfg.model
    assert (m.rope_scaling, m.rope_scaling_factor, m.rope_original_max_position_embeddings) == ("yarn", 4.0, 16)
    assert (m.rope_beta_fast, m.rope_beta_slow, m.rope_mscale, m.rope_mscale_all_dim) == (16.0, 2.0, 1.2, 0.4)
    assert m.rope_theta == 500000.0


def test_config_refuses_unknown_rope_scaling_name():
    """Guards against a typo in --model.rope_scaling reaching the model build."""
    from grpo_mega.config import Config, ConfigError
    from grpo_mega.preflight.validate import validate

    cfg = Config()
    cfg.model.rope_scaling = "dynamic"
    with pytest.raises(ConfigError, match="model.rope_scaling"):
        validate(cfg, 1, check_hardware=False)
