"""Packing multi-turn episodes: the loss reads the model's tokens only."""
from __future__ import annotations

import torch

from grpo_mega.trainer.batch import TrainingBatch
from grpo_mega.trainer.dynamic_sampling import keep_groups
from grpo_mega.rollout.types import RolloutBatch


def _episode_batch() -> tuple[list, list, list, list]:
    # Row 0: prompt [5, 6], then model [7, 8], tool reply [90, 91, 92], model [9].
    # Row 1: prompt [5], then model [7] only (a one-turn episode).
    prompts = [[5, 6], [5]]
    responses = [[7, 8, 90, 91, 92, 9], [7]]
    logps = [[-0.1, -0.2, 0.0, 0.0, 0.0, -0.3], [-0.4]]
    mask = [[1, 1, 0, 0, 0, 1], [1]]
    return prompts, responses, logps, mask


def test_multi_turn_tool_tokens_are_never_in_the_loss_mask():
    """Catches a tool token in the loss mask (the environment's reply trained on as if the
    model had sampled it), and model tokens after a tool reply left out or shifted by one."""
    prompts, responses, logps, mask = _episode_batch()
    b = TrainingBatch.pack(prompts, responses, logps, [1.0, -1.0], pad_id=0, response_mask=mask)
    # Shifted grid: column t predicts tokens[t + 1]. Row 0's response starts at column 1.
    expect0 = [False, True, True, False, False, False, True]
    assert b.loss_mask[0].tolist() == expect0
    assert b.targets[0][b.loss_mask[0]].tolist() == [7, 8, 9]
    assert b.loss_mask[1].tolist() == [True] + [False] * 6
    # Every model token keeps its own rollout log-prob, at its own position.
    torch.testing.assert_close(b.rollout_logp[0][b.loss_mask[0]], torch.tensor([-0.1, -0.2, -0.3]))
    torch.testing.assert_close(b.rollout_logp[1][b.loss_mask[1]], torch.tensor([-0.4]))


def test_multi_turn_per_token_advantages_stay_on_their_tokens():
    """Catches per-token advantages (process supervision) placed by the masked grid, which
    would slide every advantage after a tool reply onto the wrong model token."""
    prompts, responses, logps, mask = _episode_batch()
    adv = torch.tensor([[1.0, 2.0, 50.0, 50.0, 50.0, 3.0], [4.0, 0, 0, 0, 0, 0]])
    b = TrainingBatch.pack(prompts, responses, logps, adv, pad_id=0, response_mask=mask)
    torch.testing.assert_close(b.advantages[0][b.loss_mask[0]], torch.tensor([1.0, 2.0, 3.0]))


def test_multi_turn_mask_of_the_wrong_length_is_refused():
    """Catches a response mask that does not cover every response token being used anyway
    (it would mark the wrong tokens as the model's)."""
    prompts, responses, logps, mask = _episode_batch()
    try:
        TrainingBatch.pack(prompts, responses, logps, [1.0, -1.0], pad_id=0, response_mask=[[1, 1], [1]])
    except ValueError as e:
        assert "response_mask" in str(e)
    else:
        raise AssertionError("a short response mask was accepted")


def test_multi_turn_masks_survive_dynamic_sampling_and_batch_selection():
    """Catches the response mask dropped when DAPO keeps groups or when a batch is cut per
    replica (tool tokens would then be trained on in refill steps only)."""
    prompts, responses, logps, mask = _episode_batch()
    rb = RolloutBatch(prompt_ids=prompts, response_ids=responses, logprobs=logps, finish_reasons=["stop"] * 2,
                      prompt_index=[0, 1], group_size=1, response_mask=mask, episode_rewards=[1.0, 0.0],
                      episode_info=[{}, {}])
    assert rb.select([0]).response_mask == [mask[0]]
    assert RolloutBatch.concat([rb.select([0]), rb.select([1])]).response_mask == mask
    kept = keep_groups(RolloutBatch(prompt_ids=prompts * 2, response_ids=responses * 2, logprobs=logps * 2,
                                    finish_reasons=["stop"] * 4, prompt_index=[0, 0, 1, 1], group_size=2,
                                    response_mask=mask * 2), [1.0, 0.0, 1.0, 1.0], 2)
    assert kept.response_mask == mask
    kept.extend(kept.groups(0, 1))
    assert kept.groups(1, 2).response_mask == mask
