"""``model.lora``: the nested config section (YAML and ``--model.lora.<field>`` flags) and the
start-up refusals of ``preflight/lora.py``."""
from __future__ import annotations

import pytest

from grpo_mega.config import ConfigError, Config, LoraConfig, apply_overrides, load_config
from grpo_mega.preflight.validate import validate


def test_lora_flags_turn_the_section_on_and_set_one_field():
    """Guards nested-section flags: ``--model.lora.rank=4`` must build ``model.lora`` with its
    defaults and rank 4 (not fail as an unknown field, nor set rank on the model), and an
    unknown sub-field must be refused naming the section's fields."""
    cfg = apply_overrides(Config(), ["--model.lora.rank=4", "--model.lora.target_modules=linear_qkv,linear_proj"])
    assert cfg.model.lora == LoraConfig(rank=4, target_modules=["linear_qkv", "linear_proj"])
    assert apply_overrides(Config(), []).model.lora is None
    with pytest.raises(ConfigError, match="model.lora has"):
        apply_overrides(Config(), ["--model.lora.rnak=4"])
    assert apply_overrides(cfg, ["--model.lora=null"]).model.lora is None


def test_lora_section_from_yaml_and_from_a_saved_dict(tmp_path):
    """Guards a YAML ``lora:`` mapping kept as a dict (every ``.rank`` then fails later, in a
    rank) and a checkpoint's saved config (``dataclasses.asdict``) not turned back into one."""
    import dataclasses

    from grpo_mega.config import ModelConfig

    f = tmp_path / "c.yaml"
    f.write_text("model:\n  lora:\n    rank: 2\n    sync: adapter\n")
    cfg = load_config(str(f))
    assert cfg.model.lora == LoraConfig(rank=2, sync="adapter")
    assert ModelConfig(**dataclasses.asdict(cfg.model)).lora == cfg.model.lora
    f.write_text("model:\n  lora:\n    rank: 2\n    ranks: 3\n")
    with pytest.raises(ConfigError, match="unknown field 'ranks'"):
        load_config(str(f))


@pytest.mark.parametrize("flags, match", [
    (["--model.lora.rank=0"], "model.lora.rank=0"),
    (["--model.lora.target_modules=linear_qkv,mlp"], "model.lora.target_modules"),
    (["--model.lora.init=zeros"], "model.lora.init='zeros'"),
    (["--model.lora.sync=delta"], "model.lora.sync='delta'"),
    (["--model.lora.dropout=1.0"], "model.lora.dropout"),
    (["--model.transformer_impl=transformer_engine"], "--model.transformer_impl=local"),
    (["--algorithm.kl_coef=0.1", "--algorithm.ref_reset_every=5"], "--algorithm.ref_reset_every=0"),
    (["--checkpoint.offload_reference=true"], "--checkpoint.offload_reference=false"),
    (["--model.lora.sync=adapter", "--rollout.placement=separate"], "--model.lora.sync=merged"),
    (["--model.family=qwen3_moe", "--model.num_experts=4", "--model.moe_ffn_hidden_size=64"], "MoE models"),
])
def test_lora_start_up_refuses_what_it_cannot_run(flags, match):
    """Guards LoRA combinations that would run wrong silently: the TE spec (its fused layer norm
    hides the normed input from the adapter), a reference reset (the reference is the frozen
    base), an offloaded reference (there is none), MoE (the reference view would replay the
    policy's routing), adapter sync into separate engines (refused only once the model and
    engines were built), and knobs out of range; each refusal names its flag."""
    cfg = apply_overrides(Config(), ["--model.lora.rank=4", *flags])
    with pytest.raises(ConfigError, match=match.replace("(", r"\(").replace("[", r"\[")):
        validate(cfg, world_size=1, check_hardware=False)


def test_lora_default_passes_start_up_and_init_names_match_the_registry():
    """Guards the start-up's list of inits drifting from ``grpo_mega.lora.LORA_INITS`` (a
    registered init refused, or a refused one documented)."""
    from grpo_mega.lora import LORA_INITS
    from grpo_mega.preflight.lora import LORA_INIT_NAMES

    assert tuple(LORA_INITS) == LORA_INIT_NAMES
    validate(apply_overrides(Config(), ["--model.lora.rank=4"]), world_size=1, check_hardware=False)
