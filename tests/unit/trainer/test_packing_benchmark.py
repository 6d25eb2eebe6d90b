"""The packing benchmark's smoke run (``benchmarks/bench_packing.py --smoke``), in-process."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_packing.py"


def test_packing_benchmark_smoke_compares_the_same_tokens(capsys):
    """Guards against the packing benchmark rotting as the passes' API moves (it drives
    ``plan_micro_batches`` / ``cut`` / ``compute_logprobs`` / ``update_policy`` directly),
    and against a comparison of unlike batches: the padded, packed and token-budget rows
    must train the same tokens, packed ones computing no padding, and the no-padding
    reference must carry (within rounding) as many tokens in rows of one length."""
    spec = importlib.util.spec_from_file_location("bench_packing", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from grpo_mega.distributed.state import destroy_parallel

    try:
        rows = bench.main(["--smoke"])
    finally:
        destroy_parallel()  # the xdist worker runs other files in this process
    assert set(rows) == {"padded", "packed", "budget", "no-pad"}
    assert rows["padded"]["tokens"] == rows["packed"]["tokens"] == rows["budget"]["tokens"]
    assert rows["padded"]["trained"] == rows["packed"]["trained"] == rows["budget"]["trained"]
    assert rows["padded"]["pad_frac"] > 0.2  # the long-tailed draw pads
    for name in ("packed", "budget", "no-pad"):
        assert rows[name]["pad_frac"] == pytest.approx(0.0, abs=0.0), name
    assert abs(rows["no-pad"]["tokens"] - rows["padded"]["tokens"]) <= 8  # 8 rows, each length rounded
    assert rows["packed"]["act"] < rows["padded"]["act"]
    assert "packed / padded" in capsys.readouterr().out
