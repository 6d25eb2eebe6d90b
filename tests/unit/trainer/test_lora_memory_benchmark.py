"""The LoRA vs full fine-tuning benchmark's smoke run (``benchmarks/bench_lora_memory.py --smoke``), in-process."""
from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_lora_memory.py"


def test_lora_memory_benchmark_smoke_counts_what_lora_drops(capsys):
    """Guards against the LoRA benchmark rotting as the lora/optimizer/passes APIs move (it
    drives ``attach_lora``, ``ReferenceView``, ``compute_logprobs`` and ``update_policy``), and
    against a comparison of unlike states: the LoRA run must hold the same base weights, no
    reference copy, and gradients and Adam moments for the adapters only (full: a reference
    as large as the weights, grads and moments for every parameter). The learning comparison
    (a few warm-start steps, one GRPO step here) must train the base (a warm start whose
    optimizer never steps leaves its held-out cross-entropy where it was) and start both
    modes from that one saved base (a mode that skipped loading it compared a random model
    with the trained one: the weights' sums and the step-0 held-out figures differ), with the
    reference equal to the starting policy (a fresh random reference for full fine-tuning
    puts a KL of order 1 into its first step instead of 0)."""
    spec = importlib.util.spec_from_file_location("bench_lora_memory", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.main(["--smoke"])
    full, lora = rows["full"], rows["lora"]
    assert full["trainable"] == full["params"] and full["reference_bytes"] == full["weights_bytes"]
    assert lora["params"] == full["params"] + lora["trainable"] and 0 < lora["trainable"] < full["params"] / 10
    assert lora["reference_bytes"] == 0
    assert lora["grad_bytes"] == 4 * lora["trainable"] and full["grad_bytes"] == 4 * full["params"]
    assert lora["optimizer_bytes"] == 8 * lora["trainable"] and full["optimizer_bytes"] == 8 * full["params"]
    assert lora["sync_bytes"] == full["sync_bytes"] and lora["adapter_sync_bytes"] == 4 * lora["trainable"]
    base, fl, ll = rows["base"], full["learn"], lora["learn"]
    assert base["after"]["ce"] < base["before"]["ce"], base
    assert fl["base_sum"] == ll["base_sum"] == base["base_sum"] and fl["lr"] != ll["lr"]
    assert (fl["reward_before"], fl["accuracy_before"]) == (ll["reward_before"], ll["accuracy_before"])
    assert len(fl["curve"]) == len(ll["curve"]) == 1
    assert abs(fl["curve"][0]["kl"]) < 1e-6 and abs(ll["curve"][0]["kl"]) < 1e-6
    out = capsys.readouterr().out
    assert "lora / full: state" in out and "same initial weights in both modes: True" in out
