"""Our calls into megatron-core, checked offline against 0.19.2, the version setup.py pins on
every Python (the CPU suite runs it too; this also covers the GPU-only branches it never takes).

tests/api/megatron-core-0.19.2.json (tools/api_snapshot.py, from the wheel's source) holds the
fields of TransformerConfig (with ModelParallelConfig's), DistributedDataParallelConfig and
OptimizerConfig, and the parameters of the functions we call. Checked against it:
  * the TransformerConfig keywords ``models.gpt.transformer_config`` builds for a GPU job
    (TE spec, FP8 recipes, MoE, recompute, sequence parallelism), recorded, not built;
  * the keywords ``models.gpt.layer_spec`` passes to the layer-spec functions;
  * every call in grpo_mega's source to GPTModel, DDP and its config, megatron's optimizer
    config and factory, initialize_model_parallel and dist_checkpointing (read with ast:
    keyword names and the number of positional arguments).
A keyword 0.19.2 lacks would raise TypeError only on the first GPU job.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/models/test_megatron_gpu_api.py
"""
from __future__ import annotations

import ast
import dataclasses
import types
from pathlib import Path

import pytest
import torch

from grpo_mega.config import ModelConfig
from tests import REPO
from tests.api import signature, snapshot

SNAP = snapshot("megatron-core-0.19.2")
CONFIG_FIELDS = set(SNAP["fields"]["TransformerConfig"]) | set(SNAP["fields"]["ModelParallelConfig"])
GPU = types.SimpleNamespace(device=torch.device("cuda", 0), tp=2, pp=2, ep=2)

BASE = dict(family="qwen3", vocab_size=1000, hidden_size=64, num_layers=4, num_attention_heads=4,
            num_query_groups=2, ffn_hidden_size=128)
VARIANTS = {
    "dense": dict(),
    "selective recompute, SP": dict(recompute="selective", sequence_parallel=True),
    "full recompute": dict(recompute="full"),
    "moe": dict(family="qwen3_moe", num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                moe_aux_loss_coeff=1e-3),
    **{f"fp8 {r}": dict(fp8="hybrid", fp8_recipe=r) for r in ("delayed", "tensorwise", "blockwise", "mxfp8")},
}


def _bind(key: str, args=(), kwargs=None):
    try:
        return signature(SNAP, key).bind(*args, **(kwargs or {}))
    except TypeError as e:
        raise AssertionError(f"{key}: {len(args)} positional, keywords {sorted(kwargs or {})} do not fit "
                             f"megatron-core 0.19.2: {e}") from None


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gpu_ready_transformer_config_fields_exist_in_megatron_019(monkeypatch, variant):
    """Guards against a TransformerConfig keyword that megatron-core 0.19.2 does not have
    (TypeError at model build on every Python 3.12 GPU machine)."""
    import megatron.core.transformer.transformer_config as tc

    from grpo_mega.models.gpt import transformer_config

    got = {}
    monkeypatch.setattr(tc, "TransformerConfig", lambda **kw: got.update(kw) or types.SimpleNamespace())
    m = ModelConfig(**{**BASE, **VARIANTS[variant]})
    transformer_config(m, GPU, use_te=True, fp8=m.fp8 != "none", train=True)
    assert got, "transformer_config built no TransformerConfig"
    unknown = sorted(set(got) - CONFIG_FIELDS)
    assert not unknown, f"TransformerConfig fields megatron-core 0.19.2 lacks: {unknown}"


@pytest.mark.parametrize("use_te", [True, False])
@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_gpu_ready_layer_spec_arguments_fit_megatron_019(monkeypatch, variant, use_te):
    """Guards against layer-spec keywords (qk_layernorm, num_experts, moe_grouped_gemm,
    normalization) that 0.19.2's spec functions reject."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    from grpo_mega.models.gpt import layer_spec

    calls = []

    def recorder(name):
        def spec(*args, **kwargs):
            calls.append((name, args, kwargs))
            keys = {"input_layernorm.": "x", "pre_mlp_layernorm.": "y"}
            # the shape layer_spec edits: the keys map, and the self-attention whose core
            # attention the local spec swaps for the packed-aware one (models/packing.py)
            attn = types.SimpleNamespace(submodules=types.SimpleNamespace(core_attention=None))
            return types.SimpleNamespace(submodules=types.SimpleNamespace(sharded_state_dict_keys_map=keys,
                                                                          self_attention=attn))
        return spec

    for name in ("get_gpt_layer_with_transformer_engine_spec", "get_gpt_layer_local_spec"):
        monkeypatch.setattr(specs, name, recorder(name))
    layer_spec(ModelConfig(**{**BASE, **VARIANTS[variant]}), use_te=use_te)
    assert len(calls) == 1
    _bind(*calls[0])


# our callee name -> ("sig", snapshot key) or ("fields", snapshot class)
CALLEES = {
    "GPTModel": ("sig", "GPTModel.__init__"),
    "DistributedDataParallel": ("sig", "DistributedDataParallel.__init__"),
    "DistributedDataParallelConfig": ("fields", "DistributedDataParallelConfig"),
    "McoreOptimizerConfig": ("fields", "OptimizerConfig"),
    "get_megatron_optimizer": ("sig", "get_megatron_optimizer"),
    "initialize_model_parallel": ("sig", "initialize_model_parallel"),
    "gather_from_sequence_parallel_region": ("sig", "gather_from_sequence_parallel_region"),
    "dist_checkpointing.save": ("sig", "dist_checkpointing.save"),
    "dist_checkpointing.load": ("sig", "dist_checkpointing.load"),
    "dist_checkpointing.load_tensors_metadata": ("sig", "dist_checkpointing.load_tensors_metadata"),
}


def _callee(node: ast.Call) -> str | None:
    f = node.func
    if isinstance(f, ast.Name):
        return f.id
    if isinstance(f, ast.Attribute):
        if isinstance(f.value, ast.Name) and f.value.id == "dist_checkpointing":
            return f"dist_checkpointing.{f.attr}"
        return f.attr
    return None


def _our_calls() -> list[tuple[str, str, ast.Call]]:
    out = []
    for path in sorted((Path(REPO) / "grpo_mega").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and _callee(node) in CALLEES:
                out.append((str(path.relative_to(REPO)), _callee(node), node))
    return out


def test_gpu_ready_megatron_calls_in_our_source_fit_megatron_019():
    """Guards against a call (model, DDP, optimizer, parallel state, dist checkpointing) whose
    keywords or positional arguments megatron-core 0.19.2 rejects: every such call site in
    grpo_mega is bound to 0.19.2's signature (``**spread`` arguments are checked by the
    tests above where they are built)."""
    calls = _our_calls()
    seen = {c for _, c, _ in calls}
    assert {"GPTModel", "DistributedDataParallelConfig", "McoreOptimizerConfig",
            "initialize_model_parallel", "dist_checkpointing.save"} <= seen, seen
    bad = []
    for path, callee, node in calls:
        kind, key = CALLEES[callee]
        keywords = {k.arg: None for k in node.keywords if k.arg is not None}
        if kind == "fields":
            bad += [f"{path}:{node.lineno} {callee}({k}=...)" for k in keywords if k not in SNAP["fields"][key]]
            continue
        params = SNAP["signatures"][key]
        positional = [None] * len([a for a in node.args if not isinstance(a, ast.Starred)])
        sig = signature(SNAP, key)
        if any(k.arg is None for k in node.keywords) and not any(p["kind"] == "var_keyword" for p in params):
            # a **spread: the explicit keywords must exist (the spread is checked where built)
            bad += [f"{path}:{node.lineno} {callee}({k}=...)" for k in keywords if k not in sig.parameters]
            continue
        try:
            sig.bind_partial(*positional, **keywords)
        except TypeError as e:
            bad.append(f"{path}:{node.lineno} {callee}: {e}")
    assert not bad, bad


def test_gpu_ready_gpt_model_rope_keywords_fit_megatron_019():
    """Guards against GPTModel RoPE keywords (built per rope_scaling) that 0.19.2 lacks."""
    from grpo_mega.models.rope import gpt_model_rope_kwargs

    sig = signature(SNAP, "GPTModel.__init__")
    for scaling in ("none", "linear", "yarn", "llama3"):
        m = dataclasses.replace(ModelConfig(**BASE), rope_scaling=scaling, rope_scaling_factor=4.0)
        unknown = sorted(set(gpt_model_rope_kwargs(m)) - set(sig.parameters))
        assert not unknown, (scaling, unknown)


def test_gpu_ready_output_layer_takes_hidden_states_first_in_megatron_019():
    """Guards ``models/head.py``'s pre-hook, which swaps the first positional argument of the
    output layer (``ColumnParallelLinear.forward(input_, weight=, runtime_gather_output=)``,
    as ``GPTModel._postprocess`` calls it) for the selected rows: in 0.19.2 that argument
    must still be the hidden states, and ``weight`` (the tied embedding) a keyword."""
    params = [p["name"] for p in SNAP["signatures"]["ColumnParallelLinear.forward"]]
    assert params[:2] == ["self", "input_"], params
    assert {"weight", "runtime_gather_output"} <= set(params), params
    _bind("gather_from_sequence_parallel_region", ("hidden",),
          dict(tensor_parallel_output_grad=False, group="tp"))
