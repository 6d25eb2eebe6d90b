"""The trainer's side of multi-turn episodes (``env.name`` set).

The rollout stage plays episodes instead of single responses
(``grpo_mega.rollout.multi_turn``); this module builds what that needs from the config
(the chat codec, the environment factory), supplies the two collectives the driver
asks for (environments run on each engine replica's first rank; replicas of a
data-parallel vLLM engine take their turns together), and turns the episodes' facts
into the step's metrics. The reward of an episode is its environment's, so the reward
stage reads ``RolloutBatch.episode_rewards`` instead of scoring texts.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from grpo_mega.distributed.errors import run_on_src
from grpo_mega.rollout.multi_turn import EpisodeLimits, generate_episodes

__all__ = ["EpisodeSetup", "build_episodes", "check_env_budget", "play", "episode_stats"]

BUDGET_SHARE = 0.8
"""The largest share of the collective timeout a turn's environment steps may take: the
rest covers the generate call and the broadcast around them."""


class EpisodeSetup:
    """Everything the rollout stage needs to play episodes, built once at start-up."""

    def __init__(self, codec, make_env: Callable[[], Any], limits: EpisodeLimits):
        self.codec, self.make_env, self.limits = codec, make_env, limits


def check_env_budget(cfg) -> None:
    """``env.tool_workers`` >= 1 and 0 < ``env.turn_budget_seconds`` <= 80% of the collective
    timeout, else ValueError naming the flags: a turn's tool calls run while every other
    rank waits in a collective, and must end (or fail with a clear error) before it times out."""
    e, timeout_s = cfg.env, cfg.parallel.timeout_minutes * 60
    if not (isinstance(e.tool_workers, int) and e.tool_workers >= 1):
        raise ValueError(f"env.tool_workers={e.tool_workers!r} must be an integer >= 1 (--env.tool_workers)")
    if not 0 < e.turn_budget_seconds <= BUDGET_SHARE * timeout_s:
        raise ValueError(f"env.turn_budget_seconds={e.turn_budget_seconds!r} must be > 0 and at most "
                         f"{BUDGET_SHARE:.0%} of the collective timeout (parallel.timeout_minutes="
                         f"{cfg.parallel.timeout_minutes:g}: {BUDGET_SHARE * timeout_s:g} s); lower "
                         "--env.turn_budget_seconds or raise --parallel.timeout_minutes")


def build_episodes(cfg, tokenizer) -> Optional[EpisodeSetup]:
    """None for single-turn runs (``env.name`` unset)."""
    if not cfg.env.name:
        return None
    from grpo_mega.envs import make_env
    from grpo_mega.rollout.chat_codec import ChatCodec

    check_env_budget(cfg)
    codec = ChatCodec.for_tokenizer(tokenizer, cfg.env.chat_format)
    make_env(cfg.env.name, cfg.env.kwargs).close()  # a bad name or kwarg fails at start-up, on every rank
    limits = EpisodeLimits(max_turns=cfg.env.max_turns, max_tokens=cfg.env.max_tokens,
                           max_model_len=cfg.rollout.max_model_len, env_workers=cfg.env.tool_workers,
                           env_budget_seconds=cfg.env.turn_budget_seconds)
    return EpisodeSetup(codec, lambda: make_env(cfg.env.name, cfg.env.kwargs), limits)


def play(t, prompts: list, step: int, sampling=None, mini_batches: int = 1) -> Any:
    """This DP replica's share of the step's episodes (a ``RolloutBatch``; ``mini_batches``:
    see ``rollout.layout.prompt_slice``); ``t`` is the ``Trainer`` (not imported:
    ``trainer.py`` imports this module)."""
    engine, setup = t.engine, t.episodes
    rows = [{"messages": [dict(m) for m in p.messages], "prompt": p.text, "answer": p.reference,
             "uid": p.uid, **dict(p.metadata)} for p in prompts]
    leader = engine.replica_leader
    shared = t.ps.world_size > 1 and dist.get_world_size(engine.replica_group) > 1
    group = engine.replica_group if shared else None

    def share(fn):
        return run_on_src(fn, leader, group, "environment step")

    def any_active(flag: bool) -> bool:
        v = torch.tensor([int(flag)], dtype=torch.int64, device=t.ps.device)  # NCCL: device tensors
        dist.all_reduce(v, op=dist.ReduceOp.MAX)
        return bool(v.item())

    t.engine.resume()
    return generate_episodes(engine, rows, setup.codec, setup.make_env, sampling or engine.sampling,
                             setup.limits, step=step, to_rank=t.ps.dp_rank, to_size=t.ps.dp,
                             share=share, any_active=any_active, mini_batches=mini_batches)


def episode_stats(batch) -> list[float]:
    """Sums over this replica's episodes, in the order of ``EPISODE_KEYS`` (the reward
    stage adds them over DP and divides by the number of samples)."""
    info = batch.episode_info
    return [float(sum(i["turns"] for i in info)), float(sum(i["tool_calls"] for i in info)),
            float(sum(i["tool_errors"] for i in info)), float(sum(i["token_mismatch"] for i in info)),
            float(sum(i["env_tokens"] for i in info))]


EPISODE_KEYS = ("episode_turns", "episode_tool_calls", "episode_tool_errors", "token_mismatch",
                "episode_env_tokens")
"""Metric names of ``episode_stats``: per-episode means (``token_mismatch`` is the number
of token-exact problems found per episode: 0 by construction; anything else is a bug)."""
