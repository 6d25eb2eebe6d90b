"""Rollout engines in their own processes (``rollout.placement: separate``).

An engine server (``server``, started as ``python -m grpo_mega.rollout.remote.server``) hosts
one in-process vLLM engine, steps it one engine step at a time (``stepwise``) and tags every
generated token with the policy version that sampled it; between two steps it takes control
messages, among them weight buckets, which it receives by broadcast over a weights process
group and loads in place while the requests in flight wait with their KV cache. The
controller (``controller.RemoteEngines``, on the trainer's global rank 0 only) spawns or
accepts the servers (``launch``), implements the engine protocol the weight bridge uses and
an asynchronous submit / done / collect API. ``wire`` is what travels between them: JSON
control messages (never pickle) and flat per-dtype weight buffers.

Tests: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/rollout/test_remote_engine.py``.
"""
from grpo_mega.rollout.remote.controller import NoEngine, RemoteEngineError, RemoteEngines, remote_engines

__all__ = ["RemoteEngines", "NoEngine", "RemoteEngineError", "remote_engines"]
