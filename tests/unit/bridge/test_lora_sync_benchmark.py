"""The LoRA sync benchmark's smoke run (``benchmarks/bench_lora_sync.py --smoke``), in-process."""
from __future__ import annotations

import gc
import importlib.util
import os
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_lora_sync.py"
HAS_VLLM = importlib.util.find_spec("vllm") is not None
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
def test_lora_sync_benchmark_smoke_compares_like_with_like(capsys):
    """Guards against the LoRA sync benchmark rotting as the bridge's API moves, and against
    a comparison of unlike syncs: full and merged send the same HF tensors (the same bytes),
    the adapter sync sends the adapter alone (between its parameters' bytes and 3x them: q, k,
    v and gate, up carry the shared A), and every sync verified."""
    saved = {k: os.environ.get(k) for k in VLLM_ENV}
    os.environ.update(VLLM_ENV)
    spec = importlib.util.spec_from_file_location("bench_lora_sync", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    try:
        res = bench.main(["--smoke"])
    finally:
        from megatron.core import parallel_state as mpu
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        gc.collect()
        mpu.destroy_model_parallel()
        cleanup_dist_env_and_memory()  # the benchmark's world (the xdist worker runs other files)
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    assert res["full"]["bytes"] == res["merged"]["bytes"] and res["full"]["tensors"] == res["merged"]["tensors"]
    adapter = 4 * res["adapter_params"]  # float32
    assert adapter <= res["adapter"]["bytes"] < 3 * adapter < res["full"]["bytes"]
    assert all(res[m]["verified"] > 0 for m in ("full", "merged", "adapter"))
    assert "adapter" in capsys.readouterr().out
