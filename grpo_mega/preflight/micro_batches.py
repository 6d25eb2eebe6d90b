"""The micro-batch arithmetic and packing checked at start-up, before any process group.

With a row count (``parallel.micro_batch_size``) each DP rank's share of a mini-batch must
split into whole micro-batches. With a token budget (``parallel.max_tokens_per_micro_batch``,
``trainer.microbatches``) the row count is unused, and the budget must hold the longest
single-turn sequence: a budget below it would run every full-length response in a
micro-batch of its own, over the budget the memory plan counted.
"""
from __future__ import annotations

from grpo_mega.config import ConfigError

__all__ = ["check_micro_batches"]


def check_micro_batches(cfg, dp: int, mini: int) -> None:
    """Raise ConfigError naming the flag when ``mini`` samples per optimizer step cannot be
    cut into micro-batches at ``dp`` replicas as configured."""
    p, d, r = cfg.parallel, cfg.data, cfg.rollout
    budget = p.max_tokens_per_micro_batch
    if budget < 0:
        raise ConfigError(f"parallel.max_tokens_per_micro_batch={budget} must be >= 0 (0: "
                          "--parallel.micro_batch_size rows per micro-batch)")
    if budget:
        longest = d.max_prompt_tokens + r.max_new_tokens
        if budget < longest:
            raise ConfigError(f"parallel.max_tokens_per_micro_batch={budget} is below the longest sequence "
                              f"data.max_prompt_tokens + rollout.max_new_tokens = {longest}; raise "
                              f"--parallel.max_tokens_per_micro_batch to at least {longest}")
        return
    if mini % (dp * p.micro_batch_size):
        raise ConfigError(f"mini-batch of {mini} samples cannot split into dp={dp} x "
                          f"parallel.micro_batch_size={p.micro_batch_size}; make "
                          f"--parallel.micro_batch_size divide {mini // dp if mini % dp == 0 else mini}"
                          f" per DP rank")
