"""grpo_mega.models.hf: the per-family megatron <-> HF tables, single process, no megatron.

The multi-rank and logits checks of the same tables (every family against
transformers, through TP/PP layouts) run in tests/scripts/bridge_ranks.py.
"""
from __future__ import annotations

import pytest
import torch

from grpo_mega.models import hf as mapping

from grpo_mega.models.hf_config import hf_config_from_model_config, model_config_from_hf
from grpo_mega.config import ModelConfig
from grpo_mega.models.hf import MappingError, MissingTensorError, ShapeMismatchError


def _cfg(**kw) -> ModelConfig:
    base = dict(family="llama", vocab_size=300, hidden_size=64, num_layers=2, num_attention_heads=4,
                num_query_groups=2, head_dim=None, ffn_hidden_size=96, qkv_bias=False,
                tie_embeddings=False)
    base.update(kw)
    return ModelConfig(**base)


def _reference_grouped_qkv(q, k, v, heads, groups, d):
    """megatron's linear_qkv rows built with an explicit loop over query groups:
    for group g: its q heads, then k_g, then v_g (the layout the platform notes describe)."""
    per, rows = heads // groups, []
    for g in range(groups):
        rows += [q[(g * per + j) * d:(g * per + j + 1) * d] for j in range(per)]
        rows += [k[g * d:(g + 1) * d], v[g * d:(g + 1) * d]]
    return torch.cat(rows, 0)


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (4, 1), (8, 2)])
@pytest.mark.parametrize("bias", [False, True])
def test_qkv_split_and_merge_follow_megatron_grouped_layout(heads, groups, bias):
    """Guards against splitting linear_qkv as [all q; all k; all v] (or per head), which
    silently scrambles attention for GQA/MQA; the bias follows the same layout."""
    d, h = 32, 64
    cfg = _cfg(hidden_size=h, num_attention_heads=heads, num_query_groups=groups, head_dim=d,
               qkv_bias=bias, family="qwen2" if bias else "llama")
    gen = torch.Generator().manual_seed(0)
    rest = () if bias else (h,)
    q, k, v = (torch.randn((n * d,) + rest, generator=gen) for n in (heads, groups, groups))
    fused = _reference_grouped_qkv(q, k, v, heads, groups, d)
    name = f"decoder.layers.1.self_attention.linear_qkv.{'bias' if bias else 'weight'}"
    pairs = mapping.canonical_to_hf(name, fused, cfg)
    kind = "bias" if bias else "weight"
    assert [n for n, _ in pairs] == [f"model.layers.1.self_attn.{p}_proj.{kind}" for p in "qkv"]
    for (_, got), want in zip(pairs, (q, k, v)):
        assert torch.equal(got, want)
    assert torch.equal(mapping.hf_to_canonical(name, [q, k, v], cfg), fused)


def test_fc1_is_gate_then_up():
    """Guards against swapping SwiGLU's halves: megatron fc1 is [gate; up], HF has
    gate_proj and up_proj (silu applies to gate)."""
    cfg = _cfg()
    gate, up = torch.randn(96, 64), torch.randn(96, 64)
    pairs = dict(mapping.canonical_to_hf("decoder.layers.0.mlp.linear_fc1.weight", torch.cat([gate, up]), cfg))
    assert torch.equal(pairs["model.layers.0.mlp.gate_proj.weight"], gate)
    assert torch.equal(pairs["model.layers.0.mlp.up_proj.weight"], up)
    back = mapping.hf_to_canonical("decoder.layers.0.mlp.linear_fc1.weight", pairs, cfg)
    assert torch.equal(back, torch.cat([gate, up]))


def test_vocab_padding_rows_are_dropped_on_export_and_refused_on_import():
    """Guards against shipping megatron's padded vocabulary rows to vLLM (wrong shape,
    or a checkpoint with extra rows silently accepted)."""
    cfg = _cfg()
    padded = torch.randn(384, 64)
    [(name, t)] = mapping.canonical_to_hf("embedding.word_embeddings.weight", padded, cfg)
    assert name == "model.embed_tokens.weight" and torch.equal(t, padded[:300])
    with pytest.raises(ShapeMismatchError, match=r"\(384, 64\).*\(300, 64\)"):
        mapping.hf_to_canonical("embedding.word_embeddings.weight", [padded], cfg)
    with pytest.raises(ShapeMismatchError):
        mapping.canonical_to_hf("embedding.word_embeddings.weight", torch.randn(299, 64), cfg)


def test_tied_output_layer_maps_to_nothing():
    """Guards against exporting a tied lm_head twice (or importing one): with tied
    embeddings HF holds only embed_tokens."""
    cfg = _cfg(tie_embeddings=True)
    assert mapping.canonical_to_hf("output_layer.weight", torch.randn(300, 64), cfg) == []
    assert "lm_head.weight" not in mapping.hf_names(cfg)
    assert "output_layer.weight" not in mapping.canonical_names(cfg)
    assert "lm_head.weight" in mapping.hf_names(_cfg(tie_embeddings=False))


def test_te_fused_norm_names_map_like_local_norms():
    """Guards against a Transformer Engine model (norms fused into linear_qkv/linear_fc1
    as layer_norm_weight) exporting under no name."""
    cfg, w = _cfg(), torch.randn(64)
    te = mapping.canonical_to_hf("decoder.layers.1.self_attention.linear_qkv.layer_norm_weight", w, cfg)
    local = mapping.canonical_to_hf("decoder.layers.1.input_layernorm.weight", w, cfg)
    assert [n for n, _ in te] == [n for n, _ in local] == ["model.layers.1.input_layernorm.weight"]
    te = mapping.canonical_to_hf("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", w, cfg)
    assert te[0][0] == "model.layers.0.post_attention_layernorm.weight"


def test_te_fused_norms_are_replicated_over_tp():
    """Guards against gathering Transformer Engine's fused norm (named
    linear_qkv.layer_norm_weight, so it looks like a QKV shard) into a tp-times-too-long
    tensor when exporting from a TE model at TP>1."""
    from grpo_mega.models import layout as mcore_layout

    for name in ("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
                 "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"):
        assert mcore_layout.split_rule(name) == (None, False)
    assert mcore_layout.split_rule("decoder.layers.0.self_attention.linear_qkv.weight") == (0, False)


@pytest.mark.parametrize("family,tie", [("llama", True), ("llama", False), ("qwen2", True), ("qwen3", False)])
def test_table_covers_transformers_state_dict_and_round_trips(family, tie):
    """Guards against a table that misses or invents a tensor for a real transformers
    model, and against converters that are not exact inverses."""
    import transformers

    cls = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[family]
    kw = dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, intermediate_size=96, tie_word_embeddings=tie)
    if family == "qwen3":
        kw["head_dim"] = 32
    hf_cfg = getattr(transformers, cls + "Config")(**kw)
    sd = getattr(transformers, cls + "ForCausalLM")(hf_cfg).state_dict()
    if tie:
        sd.pop("lm_head.weight")  # a tied copy; save_pretrained does not write it
    cfg = model_config_from_hf(hf_cfg.to_dict())
    assert (cfg.family, cfg.tie_embeddings, cfg.qkv_bias) == (family, tie, family == "qwen2")
    assert set(mapping.hf_names(cfg)) == set(sd)
    for name in mapping.canonical_names(cfg):
        canon = mapping.hf_to_canonical(name, sd, cfg)
        assert tuple(canon.shape) == mapping.canonical_shape(name, cfg)
        for hf_name, t in mapping.canonical_to_hf(name, canon, cfg):
            assert torch.equal(t, sd[hf_name]), hf_name


def test_unknown_family_is_named():
    """Guards against a KeyError with no hint when the family is not in the tables."""
    with pytest.raises(MappingError, match=r"'gpt2'.*llama.*qwen2.*qwen3"):
        mapping.table("gpt2")
    with pytest.raises(MappingError, match="gpt2"):
        model_config_from_hf({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(MappingError, match="mistral"):
        mapping.canonical_names(_cfg(family="mistral"))


def test_missing_hf_tensor_is_named():
    """Guards against a bare KeyError: the message names the absent HF tensor and the
    megatron tensor that needed it."""
    cfg = _cfg()
    tensors = {"model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64),
               "model.layers.0.self_attn.v_proj.weight": torch.randn(32, 64)}
    with pytest.raises(MissingTensorError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight.*linear_qkv"):
        mapping.hf_to_canonical("decoder.layers.0.self_attention.linear_qkv.weight", tensors, cfg)


def test_shape_mismatch_names_tensor_and_both_shapes():
    """Guards against loading a checkpoint into the wrong config."""
    cfg = _cfg()
    with pytest.raises(ShapeMismatchError, match=r"down_proj\.weight.*\(64, 80\).*\(64, 96\)"):
        mapping.hf_to_canonical("decoder.layers.1.mlp.linear_fc2.weight",
                                {"model.layers.1.mlp.down_proj.weight": torch.randn(64, 80)}, cfg)
    with pytest.raises(ShapeMismatchError, match=r"linear_proj\.weight.*\(64, 32\).*\(64, 128\)"):
        mapping.canonical_to_hf("decoder.layers.0.self_attention.linear_proj.weight", torch.randn(64, 32),
                                _cfg(head_dim=32))


def test_config_rules_out_unexpected_tensors():
    """Guards against silently dropping a QKV bias the config says does not exist, or a
    layer index beyond the model."""
    with pytest.raises(MappingError, match="qkv_bias"):
        mapping.canonical_to_hf("decoder.layers.0.self_attention.linear_qkv.bias", torch.randn(256), _cfg())
    with pytest.raises(MappingError, match="layer 5"):
        mapping.canonical_to_hf("decoder.layers.5.mlp.linear_fc2.weight", torch.randn(64, 96), _cfg())
    with pytest.raises(MappingError, match="no llama mapping rule"):
        mapping.canonical_to_hf("decoder.layers.0.mlp.router.weight", torch.randn(4, 64), _cfg())


def test_hf_config_round_trip():
    """Guards against config.json fields being read wrongly (rope theta in either
    transformers layout, GQA groups, tying, Qwen2's implicit QKV bias)."""
    hf = {"model_type": "qwen2", "vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
          "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
          "tie_word_embeddings": True, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16"}
    cfg = model_config_from_hf(hf)
    assert (cfg.rope_theta, cfg.num_query_groups, cfg.qkv_bias, cfg.tie_embeddings, cfg.dtype) == \
        (5e5, 2, True, True, "bfloat16")
    again = model_config_from_hf(hf_config_from_model_config(cfg))
    assert again == cfg
    with pytest.raises(MappingError, match="o_proj bias"):
        model_config_from_hf(dict(hf, model_type="llama", attention_bias=True))
