"""Process supervision on the trainer side: step scores -> per-token advantages.

A step-scored reward marks its steps by character offsets in the completion text
(``grpo_mega.rewards.StepScores``). The last token of a step is the first response
token whose decoded prefix covers the step's end character: the prefix of the
response ids is decoded with the trainer's tokenizer (``skip_special_tokens``, as
the engine detokenises), found by bisection, so a response of T tokens and S steps
costs S * log2(T) decodes. A token that straddles a step boundary ends both steps
(``process_advantages`` then credits it with both).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from grpo_mega import algorithms as A

__all__ = ["token_step_ends", "process_token_advantages"]


def token_step_ends(char_ends: Sequence[int], response_ids: Sequence[int],
                    decode: Callable[[Sequence[int]], str]) -> list[int]:
    """Index (0-based, in the response) of the token that completes each step.

    Args:
        char_ends: exclusive character end of each step, strictly increasing.
        response_ids: the response's token ids.
        decode: token ids -> text, as the engine detokenised them.
    A step ending beyond the decoded text (text the engine added, which no token
    produced) ends at the last token; an empty response has no steps to place."""
    n = len(response_ids)
    if n == 0:
        return []
    cache: dict[int, int] = {}

    def covered(k: int) -> int:  # characters decoded from the first k tokens
        if k not in cache:
            cache[k] = len(decode(response_ids[:k]))
        return cache[k]

    out = []
    for c in char_ends:
        lo, hi = 1, n  # smallest k in [1, n] with covered(k) >= c; the step's last token is k - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if covered(mid) >= c:
                hi = mid
            else:
                lo = mid + 1
        out.append(lo - 1)
    return out


def process_token_advantages(step_scores: Sequence[Sequence[float]], step_ends: Sequence[Sequence[int]],
                             group_size: int, response_len: int) -> Tensor:
    """[B, T] per-token advantages of B responses (groups of ``group_size`` contiguous)
    from ragged per-response step scores and token step ends (``token_step_ends``),
    padded for ``algorithms.process_advantages``; T = ``response_len`` (>= 1)."""
    b, s = len(step_scores), max((len(x) for x in step_scores), default=0)
    rewards = torch.zeros(b, max(s, 1), dtype=torch.float32)
    ends = torch.full((b, max(s, 1)), -1, dtype=torch.long)
    for i, (sc, en) in enumerate(zip(step_scores, step_ends)):
        if len(sc) != len(en):
            raise ValueError(f"response {i}: {len(sc)} step scores but {len(en)} step ends")
        rewards[i, :len(sc)] = torch.tensor(sc, dtype=torch.float32)
        ends[i, :len(en)] = torch.tensor(en, dtype=torch.long)
    return A.process_advantages(rewards, ends, group_size, response_len)
