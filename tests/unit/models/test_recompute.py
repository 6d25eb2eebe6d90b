"""Activation recomputation (``model.recompute``): megatron's ``full`` and ``selective``
granularities give the same loss and gradients as storing every activation, and really
recompute (the layers or the core attention run again in the backward)."""
from __future__ import annotations

import pytest

from grpo_mega.config import ConfigError, load_config
from grpo_mega.preflight.validate import validate
from tests.distributed import run_ranks


def _recompute_rank(rank, world, tp):
    import dataclasses

    import torch

    from grpo_mega.config import ModelConfig
    from grpo_mega.distributed.schedule import run_microbatches
    from grpo_mega.distributed.state import init_parallel
    from grpo_mega.models import build_model
    from megatron.core import parallel_state as mpu

    base = ModelConfig(vocab_size=64, hidden_size=64, num_layers=2, num_attention_heads=2,
                       num_query_groups=1, ffn_hidden_size=128, make_vocab_size_divisible_by=4)
    tokens = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(0))
    out = {}
    for mode in ("none", "selective", "full"):
        ps = init_parallel(tp, 1, seed=7)
        m = dataclasses.replace(base, recompute=mode)
        model = build_model(m, ps)
        calls = {"layer": 0, "attn": 0}
        for layer in model.decoder.layers:
            layer.register_forward_hook(lambda *a: calls.__setitem__("layer", calls["layer"] + 1))
            layer.self_attention.core_attention.register_forward_hook(
                lambda *a: calls.__setitem__("attn", calls["attn"] + 1))

        def loss_fn(logits, mb):
            loss = logits.float().pow(2).mean() * (1 + torch.arange(logits.shape[-1]).float().mean())
            return loss, {"loss": loss.detach()}

        mbs = [{"tokens": tokens[:2]}, {"tokens": tokens[2:]}]
        losses = run_microbatches(model, mbs, loss_fn, ps, forward_only=False)
        out[mode] = {"loss": [float(o["loss"]) for o in losses], "calls": dict(calls),
                     "grads": {n: p.grad.detach().numpy().copy() for n, p in model.named_parameters()}}
        mpu.destroy_model_parallel()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_recompute_full_and_selective_match_stored_activations(tp):
    """Guards against a recompute setting that changes the math (inputs not restored for the
    second forward, a chunk recomputed with the wrong layer) or that is silently ignored
    (config field never reaching megatron). (It cannot test the RNG-state restore: every
    model here is built with dropout 0, so the forward draws no random numbers.) Loss and
    every gradient of
    ``full`` and ``selective`` must equal ``none`` (1e-6), and with two micro-batches of two
    layers, ``full`` must run each layer's forward twice (8 calls, not 4) and
    ``selective`` the core attention twice with the layers once."""
    res = run_ranks(tp, _recompute_rank, tp, timeout=300)[0]
    ref = res["none"]
    assert ref["calls"] == {"layer": 4, "attn": 4}, ref["calls"]
    assert res["full"]["calls"]["layer"] == 8, res["full"]["calls"]
    assert res["selective"]["calls"] == {"layer": 4, "attn": 8}, res["selective"]["calls"]
    for mode in ("full", "selective"):
        assert res[mode]["loss"] == pytest.approx(ref["loss"], rel=1e-6)
        for n, g in ref["grads"].items():
            assert abs(res[mode]["grads"][n] - g).max() <= 1e-6 * max(abs(g).max(), 1e-12), (mode, n)


def test_recompute_and_sequence_parallel_are_validated_naming_the_flag():
    """Guards against a bad recompute setting reaching megatron (an assert deep in
    TransformerConfig after the job was queued) and sequence parallelism accepted where it
    cannot run (TP=1, or no Transformer Engine)."""
    for flags, world, msg in (
            (["--model.recompute=block"], 1, r"model.recompute='block'.*--model.recompute"),
            (["--model.recompute=full", "--model.recompute_num_layers=3", "--model.num_layers=4"], 1,
             r"recompute_num_layers=3 must divide the 4 layers.*--model.recompute_num_layers"),
            (["--model.sequence_parallel=true"], 1, r"parallel.tp > 1.*--model.sequence_parallel=false")):
        with pytest.raises(ConfigError, match=msg):
            validate(load_config(None, flags), world, check_hardware=False)
    validate(load_config(None, ["--model.recompute=full", "--model.recompute_num_layers=2",
                                "--model.num_layers=4", "--parallel.pp=2"]), 2, check_hardware=False)
    sp = load_config(None, ["--model.sequence_parallel=true", "--parallel.tp=2"])
    validate(sp, 2, check_hardware=False)
    import torch

    from grpo_mega.models.precision import te_available
    if not (torch.cuda.is_available() and te_available()):
        with pytest.raises(ConfigError, match="Transformer Engine.*--model.sequence_parallel=false"):
            validate(sp, 2, check_hardware=True)
