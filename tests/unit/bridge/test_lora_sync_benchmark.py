"""The LoRA sync benchmark's smoke run (``benchmarks/bench_lora_sync.py --smoke``), in a process of its own."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_lora_sync.py"
HAS_VLLM = importlib.util.find_spec("vllm") is not None
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
def test_lora_sync_benchmark_smoke_compares_like_with_like(tmp_path):
    """Guards against the LoRA sync benchmark rotting as the bridge's API moves, and against
    a comparison of unlike syncs: full and merged send the same HF tensors (the same bytes),
    the adapter sync sends the adapter alone (between its parameters' bytes and 3x them: q, k,
    v and gate, up carry the shared A), and every sync verified."""
    # its own process: two in-process engines after another file's in-process world left this
    # one's captured streams closed under vLLM's loggers (the worker crashed, pytest lost stderr)
    out = tmp_path / "res.json"
    r = subprocess.run([sys.executable, str(BENCH), "--smoke", "--json", str(out)], env={**os.environ, **VLLM_ENV},
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["full"]["bytes"] == res["merged"]["bytes"] and res["full"]["tensors"] == res["merged"]["tensors"]
    adapter = 4 * res["adapter_params"]  # float32
    assert adapter <= res["adapter"]["bytes"] < 3 * adapter < res["full"]["bytes"]
    assert all(res[m]["verified"] > 0 for m in ("full", "merged", "adapter"))
    assert "[bench]   adapter" in r.stdout
