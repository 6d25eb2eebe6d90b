"""Per-request helpers shared by every vLLM engine front end (in-process ``RolloutEngine``
and the stepwise server of ``rollout.remote``), so both draw and read samples identically.

* :func:`request_seed`: the seed of prompt ``key`` at ``step``; vLLM gives sample j of
  the prompt ``seed + j`` (its own fan-out for ``n > 1``; the stepwise server sends one
  request per sample with exactly that seed, so the two front ends draw the same tokens).
* :func:`check_budgets`: refuse prompts vLLM would reject mid-batch or cut short.
* :func:`sampled_logprobs`: the sampled tokens' logprobs out of a vLLM completion.
"""
from __future__ import annotations

import hashlib
from typing import Sequence

__all__ = ["request_seed", "check_budgets", "sampled_logprobs"]


def request_seed(base: int | None, step: int, prompt_index: int, n: int) -> int | None:
    """Per-prompt seed from (base, step, index); vLLM adds 0..n-1 per sample."""
    if base is None:
        return None
    digest = hashlib.sha256(f"{base}:{step}:{prompt_index}".encode()).digest()
    return int.from_bytes(digest[:4], "little") % (2**31 - n)  # seed + j stays an int32


def check_budgets(ids: Sequence[Sequence[int]], budgets: Sequence[int], max_len: int, offset: int,
                  max_new_tokens: int) -> None:
    """Raise ValueError for an empty prompt, or one whose length plus its token budget exceeds
    the engine's ``max_len`` (vLLM would reject it mid-batch or cut the response short).
    ``offset``: the batch index of ``ids[0]``, for the message."""
    for i, p in enumerate(ids):
        if not p:
            raise ValueError(f"prompt {offset + i} is empty")
        if len(p) + budgets[i] > max_len:
            raise ValueError(f"prompt {offset + i} has {len(p)} tokens; with max_new_tokens="
                             f"{max_new_tokens} it exceeds the engine's max_model_len={max_len} "
                             "(raise rollout max_model_len or lower data max_prompt_tokens)")


def sampled_logprobs(completion) -> list[float]:
    """The logprob of each sampled token (``SamplingParams(logprobs=0)`` returns exactly the
    sampled token's entry per position; ``flat_logprobs=True`` keeps them in one flat list
    instead of a dict per token, which vLLM builds and we would walk per token)."""
    lps, tokens = completion.logprobs, list(completion.token_ids)
    if lps is None or len(lps) != len(tokens):
        raise RuntimeError("vLLM returned no per-token logprobs for a sample")
    if hasattr(lps, "token_ids") and lps.token_ids == tokens:  # FlatLogprobs, one entry per position
        return list(lps.logprobs)
    return [float(lps[t][tok].logprob) for t, tok in enumerate(tokens)]
