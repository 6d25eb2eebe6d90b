"""The episodes of a trainer DP replica's share, whatever the engine layout: each engine
replica plays its own slice of the global rows with one of the two drivers, lockstep
(``multi_turn.run_episodes``) or async (``multi_turn_async.run_episodes_async``), and the
episodes are gathered and cut anew for the trainer's replicas.

Why its own module: it is the one place that chooses between the two drivers, and the async
driver builds on the lockstep one's turn bookkeeping, so the choice cannot live in either
without an import cycle.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from grpo_mega.envs.types import Environment
from grpo_mega.rollout.multi_turn import EpisodeLimits, TurnCodec, _local_share, run_episodes
from grpo_mega.rollout.multi_turn_async import StepperTurns, run_episodes_async
from grpo_mega.rollout.types import RolloutBatch, SamplingConfig

__all__ = ["generate_episodes"]


def generate_episodes(engine, global_rows: Sequence[dict], codec: TurnCodec, make_env: Callable[[], Environment],
                      sampling: SamplingConfig, limits: EpisodeLimits, *, step: int, to_rank: int = 0,
                      to_size: int = 1, share: Callable[[Callable[[], Any]], Any] = _local_share,
                      any_active: Optional[Callable[[bool], bool]] = None, mini_batches: int = 1,
                      scheduling: str = "lockstep") -> RolloutBatch:
    """The episodes of share ``to_rank`` of ``to_size`` of the global rows (a trainer DP
    replica's share of each of ``mini_batches`` blocks, ``prompt_slice``), whatever the engine layout: like ``RolloutEngine.generate_resharded``,
    each engine replica plays its own slice of the rows, and the episodes are gathered and
    cut anew. Collective over the world. ``share``/``any_active``: see ``multi_turn.run_episodes``
    (the trainer passes collectives over the engine replica and over the world).
    ``scheduling``: ``lockstep`` (``multi_turn.run_episodes``) or ``async``
    (``multi_turn_async.run_episodes_async``, an in-process engine of a one-rank replica only)."""
    from grpo_mega.data import shard_for_replica
    from grpo_mega.rollout.engine import _dist_world
    from grpo_mega.rollout.layout import gather_global, prompt_slice

    if len(global_rows) % engine.dp_size:
        raise ValueError(f"global batch of {len(global_rows)} prompts does not split over {engine.dp_size} "
                         "engine replicas; make data.prompts_per_step a multiple of the engine dp size")
    mine = shard_for_replica(list(global_rows), engine.dp_rank, engine.dp_size)
    offset = engine.dp_rank * (len(global_rows) // engine.dp_size)

    def generate(prompts, s, *, step, keys, budgets):
        return engine.generate(prompts, s, step=step, keys=keys, budgets=budgets)

    lockstep = any_active if engine.lockstep else None
    if scheduling == "async":
        if engine.mode != "inprocess" or lockstep is not None:
            raise ValueError(f"env.scheduling=async steps an in-process engine alone; this one is "
                             f"{engine.mode!r} (--env.scheduling=lockstep)")
        batch = run_episodes_async(StepperTurns(engine), codec, make_env, mine, sampling, limits, step=step,
                                   offset=offset)
    else:
        dummy = codec.first_ids([{"role": "user", "content": "hi"}], []) if lockstep else None
        batch = run_episodes(generate, codec, make_env, mine, sampling, limits, step=step, offset=offset,
                             share=share, any_active=lockstep, dummy_ids=dummy)
    rank, world = _dist_world()
    if world == 1:
        return prompt_slice(batch, len(global_rows), to_rank, to_size, mini_batches)
    everything = gather_global(batch, contributes=rank == engine.replica_leader)
    return prompt_slice(everything, len(global_rows), to_rank, to_size, mini_batches)
