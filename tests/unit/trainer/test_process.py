"""Process supervision on the trainer side: step ends in text -> token step ends ->
per-token advantages -> TrainingBatch columns -> one update's direction per token."""
from __future__ import annotations

import math

import pytest
import torch

from grpo_mega.trainer.batch import TrainingBatch
from grpo_mega.trainer.steps import process_token_advantages, token_step_ends
from tests.distributed import run_ranks

# A toy detokeniser: even ids decode to one character, odd ids to two.
def _decode(ids):
    return "".join(chr(ord("a") + i % 26) * (1 + i % 2) for i in ids)


def test_text_step_ends_map_to_the_token_that_completes_them():
    """Guards against an off-by-one between character and token step ends (a step credited
    to the token after or before the one that finishes it) and against a token that
    straddles two steps dropping one of them."""
    ids = [2, 3, 4, 5]  # "c", "dd", "e", "ff": characters end at 1, 3, 4, 6
    assert token_step_ends([1, 3, 4, 6], ids, _decode) == [0, 1, 2, 3]
    assert token_step_ends([2, 3], ids, _decode) == [1, 1]  # both end inside/at "dd"
    assert token_step_ends([5], ids, _decode) == [3]
    assert token_step_ends([], ids, _decode) == [] and token_step_ends([1], [], _decode) == []


PROMPTS = [[5, 6, 7], [8]]
RESPONSES = [[20, 21, 22], [23, 24]]


def test_batch_from_step_scores_places_per_token_advantages_on_the_loss_mask():
    """Guards against per-token advantages placed one column late (at p instead of p - 1,
    so each token trains with its neighbour's advantage), steps summed before a token
    instead of at or after it, and normalisation per sample instead of over the group.
    Hand-worked: one group of two responses; steps [1, 0] ending at tokens 0 and 2 and [1]
    ending at token 1. Group step rewards [1, 0, 1]: mean 2/3, sample std sqrt(1/3), so
    normalised +1/sqrt(3) for a 1 and -2/sqrt(3) for the 0."""
    adv = process_token_advantages([[1.0, 0.0], [1.0]], [[0, 2], [1]], 2, 3)
    b = TrainingBatch.pack(PROMPTS, RESPONSES, [[0.0] * 3, [0.0] * 2], adv, pad_id=0)
    hi, lo = 1 / math.sqrt(3), -2 / math.sqrt(3)
    # row 0: prompt of 3 -> response tokens at columns 2, 3, 4; row 1: prompt of 1 -> 0, 1
    want = torch.tensor([[0, 0, hi + lo, lo, lo],
                         [hi, hi, 0, 0, 0]])
    assert b.advantages.shape == b.loss_mask.shape
    torch.testing.assert_close(b.advantages, want, atol=1e-5, rtol=0)
    assert torch.equal(b.advantages != 0, b.loss_mask)
    # micro-batches trim the per-token advantages with the other per-token tensors
    m0, m1 = b.split(1)
    torch.testing.assert_close(m1.advantages, want[1:, :2], atol=1e-5, rtol=0)
    assert m0.advantages.shape == m0.loss_mask.shape == (1, 5)
    with pytest.raises(ValueError, match="per-token advantages"):
        TrainingBatch.pack(PROMPTS, RESPONSES, [[0.0] * 3, [0.0] * 2], adv[:, :2], pad_id=0)


VOCAB = 64
GROUP = 2
L_PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10, 11]]
L_RESPONSES = [[12, 13, 14], [15, 16], [17, 18, 19, 20], [21, 22, 23],
               [24, 25], [26, 27, 28], [29, 30, 31], [32, 33]]
# One step per token. Each pair is a group; the signs of the process advantages, worked by
# hand (x - group mean, then sums over the steps at or after each token):
#   [0,0,1] [1,1]      mean 3/5: A ~ [-.8,-.2,.4]  [.8,.4]
#   [0,0,0,1] [0,1,0]  mean 2/7: A ~ [-1,1,3,5]/7  [1,3,-2]/7
#   [1,0] [0,0,1]      mean 2/5: A ~ [.2,-.4]      [-.2,.2,.6]
#   [0,1,1] [0,0]      mean 2/5: A ~ [.8,1.2,.6]   [-.8,-.4]
STEP_SCORES = [[0, 0, 1], [1, 1], [0, 0, 0, 1], [0, 1, 0], [1, 0], [0, 0, 1], [0, 1, 1], [0, 0]]
SIGNS = [[-1, -1, 1], [1, 1], [-1, 1, 1, 1], [1, 1, -1], [1, -1], [-1, 1, 1], [1, 1, 1], [-1, -1]]


def _token_logp(model, ps, prompts, responses):
    from grpo_mega.trainer.passes import compute_logprobs

    b = TrainingBatch.pack(prompts, responses, [[0.0] * len(r) for r in responses],
                           [0.0] * len(responses), pad_id=0, device=ps.device)
    b.old_logp = b.empty_logp()
    compute_logprobs(model, b.split(3), ps, vocab_size=VOCAB, temperature=1.0, key="old_logp")
    return [row[m].tolist() for row, m in zip(b.old_logp, b.loss_mask)]


def _process_update_rank(rank, world):
    from grpo_mega.config import AlgorithmConfig, ModelConfig, OptimizerConfig
    from grpo_mega.distributed.state import init_parallel
    from grpo_mega.models import build_model
    from grpo_mega.optim.adamw import ParallelAdamW
    from grpo_mega.rewards import StepScores
    from grpo_mega.trainer.passes import update_policy

    ps = init_parallel(1, 1, seed=5)
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_attention_heads=4,
                      num_query_groups=2, ffn_hidden_size=128, make_vocab_size_divisible_by=4)
    model = build_model(cfg, ps)
    prompts = [p for p in L_PROMPTS for _ in range(GROUP)]
    before = _token_logp(model, ps, prompts, L_RESPONSES)
    # what a reward returns: one step per token, ends as character offsets of the text
    steps = [StepScores(sc, [len(_decode(r[:k + 1])) for k in range(len(r))])
             for sc, r in zip(STEP_SCORES, L_RESPONSES)]
    ends = [token_step_ends(s.ends, r, _decode) for s, r in zip(steps, L_RESPONSES)]
    adv = process_token_advantages([s.scores for s in steps], ends, GROUP, 4)
    b = TrainingBatch.pack(prompts, L_RESPONSES, [[-1.0] * len(r) for r in L_RESPONSES], adv,
                           pad_id=0, device=ps.device)
    algo = AlgorithmConfig(kl_coef=0.0, clip_low=0.2, clip_high=0.2, advantage="process")
    opt = ParallelAdamW(model, OptimizerConfig(lr=3e-3, clip_grad=0.0), ps)
    update_policy(model, opt, b.split(3), ps, algo, vocab_size=VOCAB, temperature=1.0,
                  max_len=8, reuse_current_as_old=True)
    after = _token_logp(model, ps, prompts, L_RESPONSES)
    return {"delta": [[a - c for a, c in zip(ra, rb)] for ra, rb in zip(after, before)]}


@pytest.mark.slow
def test_one_process_update_learns_toward_rewarded_steps():
    """Guards against per-token advantages that do not reach the loss as computed: a sign
    flip, steps credited to the tokens before them instead of at or after, a one-column
    shift, or a per-sequence advantage in their place. One update at TP1 must move every
    response token's log-prob the way its hand-worked process advantage points; several
    responses hold tokens of both signs, which no per-sequence advantage can produce."""
    delta = run_ranks(1, _process_update_rank, timeout=300)[0]["delta"]
    wrong = [(i, t, d) for i, (row, signs) in enumerate(zip(delta, SIGNS))
             for t, (d, sgn) in enumerate(zip(row, signs)) if (d > 0) != (sgn > 0)]
    assert not wrong, f"tokens moved against their step advantage (row, token, dlogp): {wrong}\n{delta}"
    assert min(abs(d) for row in delta for d in row) > 1e-4, delta
