"""Which way one GRPO update moves the policy: rewards -> group advantages -> TrainingBatch
-> update_policy (megatron model, pipeline schedule, vocab-parallel loss, AdamW) must raise
the log-probability of every better-than-its-group response and lower every worse one,
at TP=1 and TP=2 over gloo. The loop tests compare runs of the same code with each other,
so a sign error anywhere on this path would pass them; here it cannot."""
from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks

VOCAB = 64
GROUP = 2
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10, 11]]
# Every response uses its own tokens, so each one's log-prob is mostly moved by its own
# advantage rather than by a neighbour sharing the same output rows.
RESPONSES = [[12, 13, 14], [15, 16], [17, 18, 19, 20], [21, 22, 23],
             [24, 25], [26, 27, 28], [29, 30, 31], [32, 33]]
REWARDS = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0]


def _seq_logp(model, ps, prompts, responses, temperature):
    """Per-response summed log-prob [N] under ``model`` (through the loop's forward)."""
    from grpo_mega.trainer.batch import TrainingBatch
    from grpo_mega.trainer.passes import compute_logprobs

    b = TrainingBatch.pack(prompts, responses, [[0.0] * len(r) for r in responses],
                           [0.0] * len(responses), pad_id=0, device=ps.device)
    b.old_logp = b.empty_logp()
    compute_logprobs(model, b.split(3), ps, vocab_size=VOCAB, temperature=temperature, key="old_logp")
    return (b.old_logp * b.loss_mask).sum(-1)


def _learns_rank(rank, world, tp):
    from grpo_mega import algorithms as A
    from grpo_mega.config import AlgorithmConfig, ModelConfig, OptimizerConfig
    from grpo_mega.distributed.state import init_parallel
    from grpo_mega.models import build_model
    from grpo_mega.optim.adamw import ParallelAdamW
    from grpo_mega.trainer.batch import TrainingBatch
    from grpo_mega.trainer.passes import update_policy

    ps = init_parallel(tp, 1, seed=5)
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_attention_heads=4,
                      num_query_groups=2, ffn_hidden_size=128, make_vocab_size_divisible_by=4)
    model = build_model(cfg, ps)
    prompts = [p for p in PROMPTS for _ in range(GROUP)]
    temperature = 1.0
    before = _seq_logp(model, ps, prompts, RESPONSES, temperature)

    adv = A.group_advantages(torch.tensor(REWARDS), GROUP)
    b = TrainingBatch.pack(prompts, RESPONSES, [[-1.0] * len(r) for r in RESPONSES], adv,
                           pad_id=0, device=ps.device)
    algo = AlgorithmConfig(kl_coef=0.0, clip_low=0.2, clip_high=0.2)
    opt = ParallelAdamW(model, OptimizerConfig(lr=3e-3, clip_grad=0.0), ps)
    update_policy(model, opt, b.split(3), ps, algo, vocab_size=VOCAB, temperature=temperature,
                  max_len=8, reuse_current_as_old=True)

    after = _seq_logp(model, ps, prompts, RESPONSES, temperature)
    return {"delta": (after - before).tolist()}


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_one_update_learns_toward_rewarded_responses(tp):
    """Guards against learning the wrong way: an advantage sign flipped anywhere between the
    rewards and the optimizer (group_advantages, TrainingBatch.pack, the surrogate's -A*r,
    the micro-batch loss share, gradient reduction or the AdamW step direction) lowers the
    log-prob of rewarded responses. Each of the 8 responses must move its own way, by more
    than float noise."""
    results = run_ranks(tp, _learns_rank, tp, timeout=300)
    delta = results[-1]["delta"]
    # The direction is judged against the rewards, not against the advantages the code
    # computed: a sign flipped inside group_advantages would flip both together.
    means = [sum(REWARDS[g:g + GROUP]) / GROUP for g in range(0, len(REWARDS), GROUP)]
    better = [REWARDS[i] > means[i // GROUP] for i in range(len(REWARDS))]
    assert all(REWARDS[i] != means[i // GROUP] for i in range(len(REWARDS)))
    wrong = [(i, REWARDS[i], d) for i, (up, d) in enumerate(zip(better, delta)) if up != (d > 0)]
    assert not wrong, f"responses moved against their reward (index, reward, dlogp): {wrong}"
    assert min(abs(d) for d in delta) > 1e-3, delta
    if tp == 2:  # every TP rank computes the same full log-probs
        assert results[0]["delta"] == pytest.approx(delta, abs=1e-6)
