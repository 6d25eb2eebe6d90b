"""Weight bridge: trainer (megatron, TP x PP x DP shards) -> rollout engines (HF names), verified.

``export`` turns any layout's shards into HF-named full tensors in buckets that
never split a fused module (PP stages broadcast theirs in turn); ``sync`` holds
:class:`WeightBridge`, which after each optimizer step streams those buckets
into the engines in place, resets their prefix caches and verifies them
(``verify``: random columns / vocabulary rows probed through the engine's own
kernels), raising :class:`WeightSyncError` on every rank if any engine missed.
Engines are reached only through ``grpo_mega.rollout.RolloutEngineProtocol``
(``update_weights``, ``reset_prefix_cache``, ``probe``); the bridge never
imports vLLM (vLLM worker code lives in ``grpo_mega.rollout.worker``).

    bridge = WeightBridge(model, cfg.model, ps, engines=[engine])
    stats = bridge.sync()            # collective over all ranks; raises WeightSyncError

Tests: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/bridge/test_sync.py``.
"""
from grpo_mega.bridge.export import DEFAULT_BUCKET_BYTES, export_buckets, export_hf_weights
from grpo_mega.bridge.sync import SyncStats, WeightBridge, WeightSyncError

__all__ = ["WeightSyncError", "WeightBridge", "SyncStats", "export_buckets", "export_hf_weights",
           "DEFAULT_BUCKET_BYTES"]
