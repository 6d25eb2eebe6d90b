"""Rollouts with vLLM: configs, the engine protocol, the vLLM engine and its worker code.

``types`` holds what every side shares without importing vLLM
(:class:`SamplingConfig`, :class:`EngineConfig`, :class:`RolloutBatch` and
:class:`RolloutEngineProtocol`, the only surface the weight bridge uses);
``engine`` holds :class:`RolloutEngine`, one vLLM engine per data-parallel
replica in external_launcher / child / inprocess mode (see its docstring);
``worker`` holds all code that runs inside a vLLM worker (weight reload and
tied-weight repack, the /dev/shm file transport, the bridge's probe reads);
``samples`` the per-request seed, budget check and logprob reading both front ends share;
``remote`` the engines of ``rollout.placement: separate``, each in its own process, with
weight updates while requests are in flight (its ``__init__`` says more).
vLLM itself is imported only when an engine is built.

Tests: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/rollout/test_engine.py``.
"""
from grpo_mega.rollout.engine import RolloutEngine, resolve_engine_mode
from grpo_mega.rollout.types import (
    AdapterRolloutEngineProtocol, AsyncRolloutEngineProtocol, ENGINE_MODES, EngineConfig, RolloutBatch, RolloutEngineProtocol, SamplingConfig, logprobs_mode_for,
)

__all__ = [
    "ENGINE_MODES", "SamplingConfig", "EngineConfig", "RolloutBatch", "RolloutEngine",
    "RolloutEngineProtocol", "AsyncRolloutEngineProtocol", "AdapterRolloutEngineProtocol", "resolve_engine_mode", "logprobs_mode_for",
]
