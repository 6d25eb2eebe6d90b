"""Checkpoints: save at one TP/PP layout, resume at another; atomic pointer; clear errors."""
from __future__ import annotations

import json

import pytest
import torch

from tests.compare import max_abs_diff, max_abs_diff_all, worst
from tests.distributed import run_ranks


def _mcfg(dtype="float32"):
    from grpo_mega.config import ModelConfig
    return ModelConfig(family="qwen2", vocab_size=50, hidden_size=64, num_layers=2,
                       num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                       qkv_bias=True, tie_embeddings=True, make_vocab_size_divisible_by=4,
                       dtype=dtype)


def _canonical_with_moments(model, opt, ps, n_layers, vocab):
    import grpo_mega.models.layout as L
    per = n_layers // ps.pp
    out = {}
    for local, p in model.named_parameters():
        name = L.to_global_name(local, ps.pp_rank, per)
        out[name] = L.gather(name, p.detach(), ps.tp_group, ps.tp, vocab)
        for key, t in opt.state_tensors(p).items():
            out[f"{key}:{name}"] = L.gather(name, t, ps.tp_group, ps.tp, vocab)
    return out


def _save_then_load_elsewhere(rank, world, root):
    from megatron.core import parallel_state as mpu
    from grpo_mega.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from grpo_mega.config import OptimizerConfig
    from grpo_mega.models import build_model
    from grpo_mega.optim.adamw import ParallelAdamW
    from grpo_mega.distributed.state import init_parallel

    results = {}
    for dtype, (tp, pp), (tp2, pp2) in [("float32", (2, 1), (1, 2)), ("float32", (1, 2), (2, 1)),
                                        ("bfloat16", (2, 1), (1, 2))]:
        m = _mcfg(dtype)
        if mpu.model_parallel_is_initialized():
            mpu.destroy_model_parallel()
        ps = init_parallel(tp, pp, seed=3)
        torch.manual_seed(0)
        model = build_model(m, ps)
        opt = ParallelAdamW(model, OptimizerConfig(lr=1e-2), ps)
        for p in opt.main:  # one real step so the moments (and bf16 masters) are non-trivial
            p.grad = torch.randn_like(p)
        opt.step()
        before = _canonical_with_moments(model, opt, ps, m.num_layers, m.vocab_size)
        d = f"{root}/tp{tp}pp{pp}" + ("" if dtype == "float32" else f"_{dtype}")
        save_checkpoint(d, 1, model, opt, ps, {"model": {"vocab_size": m.vocab_size}, "data": [3, 4]})
        mpu.destroy_model_parallel()
        ps2 = init_parallel(tp2, pp2, seed=99)
        torch.manual_seed(123)
        model2 = build_model(m, ps2)
        opt2 = ParallelAdamW(model2, OptimizerConfig(lr=1e-2), ps2)
        meta = load_checkpoint(latest_checkpoint(d), model2, opt2, ps2, m)
        after = _canonical_with_moments(model2, opt2, ps2, m.num_layers, m.vocab_size)
        common = [k for k in after if k in before]
        results[f"{dtype} tp{tp}pp{pp}->tp{tp2}pp{pp2}"] = (max_abs_diff_all(after, before, keys=common),
                                                          len(common), meta["data"])
        if dtype == "bfloat16":
            # The fp32 masters travel too, not only the bf16 copy: they are among the tensors
            # compared bitwise above, and they differ from the bf16 weights (so masters rebuilt
            # from the rounded weights on load would fail that comparison).
            masters = [k for k in common if k.startswith("main_param:")]
            rounded_away = (worst(max_abs_diff(before[k], before[k.split(":", 1)[1]]) for k in masters)
                            if masters else 0.0)
            results["bf16 masters saved"] = (0.0 if masters and rounded_away > 0 else 1.0, len(masters), meta["data"])
    import multiprocessing

    # megatron's writer spawns a Manager process on a rank's first save unless it got an
    # in-process queue (checkpoint.io.in_process_write_results): 2.3 CPU-s per saving rank.
    results["no writer process"] = (float(len(multiprocessing.active_children())), 1, [3, 4])
    return results


@pytest.mark.slow
def test_checkpoint_resumes_bitwise_at_another_layout(tmp_path):
    """Guards against checkpoints tied to their layout (vocab padding that depends on TP,
    fc1 halves, optimizer moments left in the old layout), against a bf16 run that
    resumes from its rounded weights instead of its fp32 master weights, and against a
    save that starts megatron's spawned Manager process (seconds of imports per rank)."""
    res = run_ranks(2, _save_then_load_elsewhere, str(tmp_path), timeout=600)
    for r in res:
        for key, (diff, n, data) in r.items():
            assert n > 0 and diff == 0.0, f"{key}: max diff {diff} over {n} tensors"
            assert data == [3, 4]
    assert (tmp_path / "tp2pp1" / "latest").read_text().strip() == "step_00000001"
    assert not list((tmp_path / "tp2pp1").glob("*.tmp"))
    # issue 27 defect 10 (gpu_ready): every rank file carries the model-parallel RNG streams
    rank_file = torch.load(next((tmp_path / "tp2pp1").glob("step_*/rank_00001.pt")), weights_only=True)
    assert rank_file["rng_tracker"] and "rng_cpu" in rank_file


def test_missing_or_corrupt_checkpoint_is_a_clear_error(tmp_path):
    """Guards against a dangling 'latest' pointer silently starting from scratch."""
    from grpo_mega.checkpoint import CheckpointError, latest_checkpoint

    assert latest_checkpoint(tmp_path) is None
    (tmp_path / "latest").write_text("step_00000005\n")
    with pytest.raises(CheckpointError, match="step_00000005.*missing or incomplete"):
        latest_checkpoint(tmp_path)
    (tmp_path / "step_00000005").mkdir()
    with pytest.raises(CheckpointError, match="incomplete"):
        latest_checkpoint(tmp_path)
    (tmp_path / "step_00000005" / "grpo_meta.json").write_text(json.dumps({"step": 5}))
    assert latest_checkpoint(tmp_path).name == "step_00000005"


def _canonical(model, ps, n_layers, vocab):
    import grpo_mega.models.layout as L
    per = n_layers // ps.pp
    return {L.to_global_name(local, ps.pp_rank, per):
            L.gather(L.to_global_name(local, ps.pp_rank, per), p.detach(), ps.tp_group, ps.tp, vocab)
            for local, p in model.named_parameters()}


def _ref_reset_reference_round_trip(rank, world, root):
    from megatron.core import parallel_state as mpu
    from grpo_mega.checkpoint import load_checkpoint, save_checkpoint
    from grpo_mega.config import OptimizerConfig
    from grpo_mega.distributed.state import init_parallel
    from grpo_mega.models import build_model
    from grpo_mega.optim.adamw import ParallelAdamW

    m = _mcfg()
    results = {}
    for (tp, pp), (tp2, pp2) in [((2, 1), (1, 2)), ((1, 2), (2, 1))]:
        if mpu.model_parallel_is_initialized():
            mpu.destroy_model_parallel()
        ps = init_parallel(tp, pp, seed=3)
        torch.manual_seed(0)
        model = build_model(m, ps)
        opt = ParallelAdamW(model, OptimizerConfig(lr=1e-2), ps)
        ref = build_model(m, ps, frozen=True)
        with torch.no_grad():  # a reference unlike both the policy and a freshly built model
            for p in ref.parameters():
                p.add_(torch.randn_like(p))
        saved_ref = _canonical(ref, ps, m.num_layers, m.vocab_size)
        saved_model = _canonical(model, ps, m.num_layers, m.vocab_size)
        d = f"{root}/tp{tp}pp{pp}"
        with_ref = save_checkpoint(d, 3, model, opt, ps, {"data": [1]}, reference=ref)
        without = save_checkpoint(d, 2, model, opt, ps, {"data": [1]})
        mpu.destroy_model_parallel()

        ps2 = init_parallel(tp2, pp2, seed=99)
        torch.manual_seed(123)
        model2 = build_model(m, ps2)
        opt2 = ParallelAdamW(model2, OptimizerConfig(lr=1e-2), ps2)
        ref2 = build_model(m, ps2, frozen=True)
        built = _canonical(ref2, ps2, m.num_layers, m.vocab_size)
        meta = load_checkpoint(without, model2, opt2, ps2, m, reference=ref2)
        untouched = _canonical(ref2, ps2, m.num_layers, m.vocab_size)
        meta_ref = load_checkpoint(with_ref, model2, opt2, ps2, m, reference=ref2)
        loaded_ref = _canonical(ref2, ps2, m.num_layers, m.vocab_size)
        loaded_model = _canonical(model2, ps2, m.num_layers, m.vocab_size)
        key = f"tp{tp}pp{pp}->tp{tp2}pp{pp2}"
        common = [k for k in loaded_ref if k in saved_ref]  # this rank's stage in both layouts
        results[key] = {
            "stored flags": (meta["reference_stored"], meta_ref["reference_stored"]),
            "ref diff": max(float((loaded_ref[k] - saved_ref[k]).abs().max()) for k in common),
            "ref tensors compared": len(common),
            "model diff": max(float((loaded_model[k] - saved_model[k]).abs().max()) for k in common),
            "initial-flag load left ref as built": all(torch.equal(untouched[k], built[k]) for k in built),
            "ref differs from policy": all(not torch.equal(saved_ref[k], saved_model[k]) for k in saved_ref),
        }
    return results


@pytest.mark.slow
def test_ref_reset_reference_is_checkpointed_and_reshards(tmp_path):
    """Guards against a resume after an iterative-GRPO reset silently going back to the
    initial reference: a checkpoint given the reset reference stores it (and says so in
    grpo_meta.json), and loading restores it bitwise at another layout (TP=2 -> PP=2 and
    back), separately from the policy; a checkpoint saved before any reset says
    ``reference_stored: false`` and leaves the built (initial) reference untouched."""
    res = run_ranks(2, _ref_reset_reference_round_trip, str(tmp_path), timeout=600)
    for r in res:
        for key, v in r.items():
            assert v["stored flags"] == (False, True), key
            assert v["ref tensors compared"] > 0, key
            assert v["ref diff"] == 0.0 and v["model diff"] == 0.0, (key, v)
            assert v["initial-flag load left ref as built"], key
            assert v["ref differs from policy"], key


def test_gpu_ready_checkpoint_saves_cuda_and_model_parallel_rng_streams(monkeypatch):
    """Guards against issue 27's defect 10: the checkpoint saved the CPU generator only,
    so a resumed GPU run drew dropout and other randomness from fresh CUDA generators and
    fresh megatron model-parallel streams. The saved state must carry every CUDA device's
    generator (the GPU branch, driven here through a stand-in for the two torch.cuda calls)
    and the tracker's named streams, and restoring it must replay the same draws."""
    from megatron.core import tensor_parallel

    from grpo_mega.checkpoint.trainer_state import restore_rng, rng_state
    from grpo_mega.distributed import cpu_compat

    cpu_compat.apply()
    tracker = tensor_parallel.get_cuda_rng_tracker()
    saved_tracker = tracker.get_states()
    tracker.reset()
    tracker.add("model-parallel-rng", 4321)
    cuda = {"state": [torch.tensor([1, 2], dtype=torch.uint8), torch.tensor([3], dtype=torch.uint8)]}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: list(cuda["state"]))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda s: cuda.update(state=list(s)))
    try:
        state = rng_state()
        with tracker.fork():
            first = torch.rand(4)
        cuda["state"] = []
        restore_rng(state)
        with tracker.fork():
            again = torch.rand(4)
        torch.testing.assert_close(again, first, rtol=0, atol=0)
        assert [t.tolist() for t in cuda["state"]] == [[1, 2], [3]]
        assert set(state) >= {"rng_cpu", "rng_cuda", "rng_tracker"}
    finally:
        tracker.reset()
        if saved_tracker:
            tracker.set_states(saved_tracker)
