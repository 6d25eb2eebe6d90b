"""``kl_kind: full`` at PP=2: the reference's hidden states travel between pipeline stages
next to the policy's. One GRPO update at PP=2 (gloo, 2 ranks) must equal the same update at
PP=1, whose exact-KL path ``test_full_kl.py`` checks against float64. Policy and reference
come from two different tiny HF checkpoints, so the KL term is far from zero."""
from __future__ import annotations

import functools

import pytest

from tests.compare import max_abs_diff_all, worst
from tests.distributed import run_ranks
from tests.unit.trainer.test_batch import _batch

TEMP, MAX_LEN, KL_COEF = 0.8, 8, 0.5


def _update_rank(rank, world, policy_dir, ref_dir, pp):
    import dataclasses

    import torch

    from grpo_mega.checkpoint.convert import load_hf_weights
    from grpo_mega.config import AlgorithmConfig, OptimizerConfig
    from grpo_mega.distributed.state import init_parallel
    from grpo_mega.models import build_model
    from grpo_mega.models import layout as mcore_layout
    from grpo_mega.checkpoint.hf_files import read_hf_config
    from grpo_mega.models.hf_config import model_config_from_hf
    from grpo_mega.optim.adamw import ParallelAdamW
    from grpo_mega.trainer.passes import metrics_to_floats, update_policy

    class Recording(ParallelAdamW):
        def step(self, reduce=True):
            self.reduce_grads()
            self.grads = [p.grad.clone() for p in self.main]
            return super().step(reduce=False)

    cfg = dataclasses.replace(model_config_from_hf(read_hf_config(policy_dir)), make_vocab_size_divisible_by=4)
    ps = init_parallel(1, pp, seed=5)
    model, ref = build_model(cfg, ps), build_model(cfg, ps, frozen=True)
    load_hf_weights(model, policy_dir, ps, cfg)
    load_hf_weights(ref, ref_dir, ps, cfg)
    algo = AlgorithmConfig(kl_coef=KL_COEF, kl_kind="full", clip_low=0.2, clip_high=0.28)
    opt = Recording(model, OptimizerConfig(lr=1e-3), ps)
    micro = _batch().split(2)  # 3 micro-batches of widths 6, 7, 6
    metrics = metrics_to_floats(update_policy(model, opt, micro, ps, algo, vocab_size=cfg.vocab_size,
                                              temperature=TEMP, max_len=MAX_LEN,
                                              reuse_current_as_old=True, reference=ref))
    per = cfg.num_layers // pp
    names = [mcore_layout.to_global_name(n, ps.pp_rank, per) for n, _ in model.named_parameters()]
    return {"metrics": metrics if ps.is_last_stage else None,
            # numpy: torch tensors would cross the queue as shared memory that dies with the rank
            "grads": {n: g.numpy() for n, g in zip(names, opt.grads)},
            "weights": {n: p.detach().numpy().copy() for n, p in zip(names, model.parameters())}}


@functools.lru_cache(maxsize=None)
def _launch(tmp: str):
    from grpo_mega.testing.tiny import build_tiny_hf_checkpoint

    kw = dict(vocab_size=50, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
              intermediate_size=96, tie_word_embeddings=False, init_std=0.2)
    policy = build_tiny_hf_checkpoint(f"{tmp}/policy", seed=0, **kw)
    ref = build_tiny_hf_checkpoint(f"{tmp}/ref", seed=1, **kw)
    pp2 = run_ranks(2, _update_rank, str(policy), str(ref), 2, timeout=300)
    pp1 = run_ranks(1, _update_rank, str(policy), str(ref), 1, timeout=300)
    return pp1[0], pp2


@pytest.mark.slow
def test_pp2_full_kl_update_equals_pp1(tmp_path_factory):
    """Guards the PP>1 transport of the reference for the exact KL: reference hidden states
    dropped (the next stage's reference running on the policy's half, or on nothing), the
    halves swapped, the reference half taking part in the backward, or the policy's
    gradient not flowing back through the doubled activation all move the loss, the KL
    metric, the gradients or the updated weights away from the PP=1 update."""
    one, (s0, s1) = _launch(str(tmp_path_factory.mktemp("kl_pp")))
    m1, m2 = one["metrics"], s1["metrics"]
    assert m1["kl"] > 1e-2, "the reference must differ from the policy for the test to bite"
    for k in ("loss", "kl", "entropy", "grad_norm"):
        assert m2[k] == pytest.approx(m1[k], rel=1e-5, abs=1e-7), (k, m2[k], m1[k])
    stages = {**s0["grads"], **s1["grads"]}
    assert set(stages) == set(one["grads"])
    scale = worst(float(abs(g).max()) for g in one["grads"].values())
    assert max_abs_diff_all(stages, one["grads"]) <= 1e-5 * scale
    weights = {**s0["weights"], **s1["weights"]}
    assert max_abs_diff_all(weights, one["weights"], keys=one["weights"]) <= 1e-6
