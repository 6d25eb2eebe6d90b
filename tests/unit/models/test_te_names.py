"""Transformer Engine parameter names without Transformer Engine (issue 27, defect 2).

A GPU run builds megatron's TE layer spec, whose names differ from the local spec's that the
CPU suite trains: the pre-attention and dense pre-MLP norms are fused into the next linear
(``linear_qkv.layer_norm_weight``), Qwen3-MoE's grouped-GEMM experts are one module per layer
(``mlp.experts.linear_fc1.weight0..weight{E-1}``, no ``local_experts.{e}``), and the MoE
layer's ``pre_mlp_layernorm`` is a real norm whose sharded key is not renamed. These tests
build the TE spec through megatron's own code on CPU (``tests/te_stub`` stands in for TE's
base modules; one 2-rank launch, tests/scripts/te_names_ranks.py) and check that the mapping
tables, conversion, checkpoint loading and the bridge's export accept every name.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/models/test_te_names.py
"""
from __future__ import annotations

import pytest

from grpo_mega.checkpoint import convert
from grpo_mega.models import hf as mapping
from grpo_mega.models import layout
from tests.scripts import te_names_ranks

TAGS = [f"{v} tp{tp} ep{ep}" for v, layouts in te_names_ranks.LAYOUTS.items() for tp, ep in layouts]


@pytest.fixture(scope="module")
def reports():
    return te_names_ranks.launch()


def _names(reports, variant):
    return reports[0][f"names {variant}"]


@pytest.mark.parametrize("variant", list(te_names_ranks.VARIANTS))
def test_gpu_ready_stub_builds_megatrons_te_spec(reports, variant):
    """Guards against this file proving nothing: the models must carry the TE spec's own
    names (fused norms; grouped experts and a real pre-MLP norm for MoE), not the local spec's."""
    got = _names(reports, variant)
    params, keys = set(got["params"]), set(got["keys"])
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in params
    assert not any("input_layernorm" in n or "local_experts" in n for n in params)
    if variant == "qwen3_moe":
        assert {"decoder.layers.1.mlp.experts.linear_fc1.weight3", "decoder.layers.1.mlp.experts.linear_fc2.weight0",
                "decoder.layers.0.pre_mlp_layernorm.weight"} <= params
        assert {"decoder.layers.pre_mlp_layernorm.weight",
                "decoder.layers.mlp.experts.experts.linear_fc1.weight"} <= keys
    else:
        assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in params
    if variant.startswith("qwen3"):
        assert "decoder.layers.0.self_attention.q_layernorm.weight" in params


@pytest.mark.parametrize("variant", list(te_names_ranks.VARIANTS))
def test_gpu_ready_mapping_table_accepts_every_te_parameter(reports, variant):
    """Guards against a TE parameter the family's table has no rule for (grouped experts
    ``weight{e}`` broke the qwen3_moe table): each name, made canonical as the bridge and the
    loaders do, maps to HF tensors of the right shapes, and together they are the whole model."""
    got = _names(reports, variant)
    cfg, hf = got["cfg"], []
    for name in got["params"]:
        canonical = layout.to_global_name(name, 0, cfg.num_layers)
        hf += mapping.hf_names_for(canonical, cfg)
        assert mapping.canonical_shape(canonical, cfg)  # raises on a name without a rule
    assert sorted(hf) == sorted(mapping.hf_names(cfg))


@pytest.mark.parametrize("variant", list(te_names_ranks.VARIANTS))
def test_gpu_ready_converted_checkpoint_keys_are_the_te_models_keys(reports, variant):
    """Guards against hf_to_mcore writing a tensor under a key the TE model does not ask for
    (the MoE ``pre_mlp_layernorm`` stored under the dense spec's fused key): the converter's
    keys equal the TE model's sharded-state keys (TE's FP8 ``_extra_state`` aside)."""
    got = _names(reports, variant)
    te_keys = {k for k in got["keys"] if not k.endswith("_extra_state")}
    assert set(convert._expected_keys(got["cfg"])) == te_keys


@pytest.mark.parametrize("tag", TAGS)
def test_gpu_ready_te_model_loads_converted_checkpoint_and_exports_it(reports, tag):
    """Guards against a TE model that cannot load an hf_to_mcore checkpoint, loads it into the
    wrong tensors, or that the bridge exports wrongly (grouped experts and their EP offsets):
    every rank gets the original HF tensors back bit for bit, and the direct HF load agrees."""
    for r in reports:
        assert r[f"export {tag}"] == []
        assert r[f"hf_load {tag}"] == []


@pytest.mark.parametrize("tag", TAGS)
def test_gpu_ready_checkpoints_move_between_te_and_local_spec(reports, tag):
    """Guards against a checkpoint trained on CPU (local spec) that a GPU run (TE spec) cannot
    resume, or the reverse, and against mcore_to_hf rejecting a TE model's checkpoint: all
    three give back the original HF tensors."""
    for r in reports:
        assert r[f"te_to_local {tag}"] == []
        assert r[f"local_to_te {tag}"] == []
        assert r[f"te_to_hf {tag}"] == []


def test_moe_checkpoint_with_the_old_norm_key_is_refused_with_the_fix_named(tmp_path):
    """Guards against an MoE checkpoint written before the key fix (pre_mlp_layernorm under the
    dense spec's fused key) failing with megatron's bare KeyError: the error names both keys
    and how to get a loadable checkpoint."""
    import types

    from grpo_mega.config import ModelConfig
    from grpo_mega.models.hf import MissingTensorError

    cfg = ModelConfig(family="qwen3_moe", vocab_size=100, hidden_size=64, num_layers=2, num_attention_heads=2,
                      num_query_groups=1, ffn_hidden_size=64, num_experts=4, moe_router_topk=2,
                      moe_ffn_hidden_size=32)
    meta = {k: types.SimpleNamespace(global_shape=v) for k, v in convert._expected_keys(cfg).items()}
    meta["decoder.layers.mlp.linear_fc1.layer_norm_weight"] = meta.pop("decoder.layers.pre_mlp_layernorm.weight")
    with pytest.raises(MissingTensorError, match="pre_mlp_layernorm.*linear_fc1.layer_norm_weight.*convert"):
        convert._validate_checkpoint(meta, cfg, tmp_path)
