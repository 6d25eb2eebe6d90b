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
from grpo_mega.preflight.env_budget import check_env_budget, turn_budget_seconds
from grpo_mega.rollout.multi_turn import EpisodeLimits
from grpo_mega.rollout.multi_turn_layout import generate_episodes

__all__ = ["EpisodeSetup", "build_episodes", "check_env_budget", "play", "prompt_row", "episode_source",
           "episode_stats"]


class EpisodeSetup:
    """Everything the rollout stage needs to play episodes, built once at start-up."""

    def __init__(self, codec, make_env: Callable[[], Any], limits: EpisodeLimits):
        self.codec, self.make_env, self.limits = codec, make_env, limits
        self.remote: Optional[Any] = None
        """``rollout.placement: separate``: global rank 0's ``RemoteEpisodes`` (``episode_source``)."""


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
                           env_budget_seconds=turn_budget_seconds(cfg),
                           step_timeout_seconds=cfg.env.step_timeout_seconds, error_reward=cfg.env.error_reward)
    return EpisodeSetup(codec, lambda: make_env(cfg.env.name, cfg.env.kwargs), limits)


def play(t, prompts: list, step: int, sampling=None, mini_batches: int = 1) -> Any:
    """This DP replica's share of the step's episodes (a ``RolloutBatch``; ``mini_batches``:
    see ``rollout.layout.prompt_slice``); ``t`` is the ``Trainer`` (not imported:
    ``trainer.py`` imports this module)."""
    engine, setup = t.engine, t.episodes
    rows = [prompt_row(p) for p in prompts]
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
                             share=share, any_active=any_active, mini_batches=mini_batches,
                             scheduling=t.cfg.env.scheduling)


def prompt_row(p) -> dict:
    """The environment's row of a dataset ``Prompt`` (what ``env.reset`` reads)."""
    return {"messages": [dict(m) for m in p.messages], "prompt": p.text, "answer": p.reference,
            "uid": p.uid, **dict(p.metadata)}


def episode_source(t) -> Any:
    """Separate engines (``rollout.placement: separate``, global rank 0): the episodes'
    ``submit``/``collect`` over ``t.engine`` (``rollout.multi_turn_remote.RemoteEpisodes``,
    built once), which the asynchronous pipeline calls as it calls the engines."""
    setup = t.episodes
    if setup.remote is None:
        from grpo_mega.rollout.multi_turn_remote import RemoteEpisodes
        setup.remote = RemoteEpisodes(t.engine, setup.codec, setup.make_env, setup.limits, to_row=prompt_row)
    return setup.remote


def episode_stats(batch) -> list[float]:
    """Sums over this replica's episodes, in the order of ``EPISODE_KEYS`` (the reward
    stage adds them over DP and divides by the number of samples)."""
    info = batch.episode_info
    return [float(sum(i.get(k, 0) for i in info)) for k in _INFO_KEYS]


EPISODE_KEYS = ("episode_turns", "episode_tool_calls", "episode_tool_errors", "token_mismatch",
                "episode_env_tokens", "episode_env_errors", "episodes_dropped")
"""Metric names of ``episode_stats``: per-episode means (``token_mismatch`` is the number
of token-exact problems found per episode: 0 by construction; anything else is a bug, and
the episode's group is dropped from training, counted in ``episodes_dropped``)."""
_INFO_KEYS = ("turns", "tool_calls", "tool_errors", "token_mismatch", "env_tokens", "env_error", "dropped")
