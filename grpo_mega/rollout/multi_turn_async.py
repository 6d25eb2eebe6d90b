"""Multi-turn episodes, each advancing on its own: no lockstep turns.

What: :func:`run_episodes_async` plays the same episodes as ``multi_turn.run_episodes``
(same requests, seeds, budgets, token-exact trajectories and batch), but an episode's next
turn is queued the moment its environment has answered, and its environment is stepped the
moment its turn is sampled. The lockstep driver waits, turn by turn, for the slowest
generation of every episode and then for the slowest tool call before any episode goes on;
here a fast episode runs several turns while a slow tool call of another is still out.

How: the engine is stepped one decoding step at a time (:class:`TurnEngine`, vLLM's
``LLMEngine.add_request``/``step`` through ``remote.stepwise.Stepper``: continuous
batching, requests join and leave between steps). Tool-answering ``env.step`` calls run in
a thread pool of ``EpisodeLimits.env_workers`` (the bound on tool calls at once) while the
calling thread keeps stepping the engine, so generation and tools overlap; final answers
are scored on the calling thread between engine steps (a reward's timeout may need the main
thread), as in the lockstep driver. Per-episode token budgets and the per-step timeout hold
as there (``multi_turn.room``, ``step_timeout_seconds``); an environment failure ends its own
episode. There is no per-turn budget: nothing waits for a turn as a whole.

Where it applies: an engine replica that is one process and free to step alone (the
in-process engine of a one-rank job, an engine server). A replica of several ranks (vLLM's
external launcher) must call the engine together on every rank and keeps the lockstep
driver (``env.scheduling``).

Seeds: turn t of an episode draws with the key ``step * TURN_SEED_STRIDE + t`` and the
episode's key, as in the lockstep driver, so both drivers ask the engine for the same
random streams.
"""
from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Optional, Protocol, Sequence

from grpo_mega.envs.types import Environment
from grpo_mega.rollout.multi_turn import (TURN_SEED_STRIDE, EpisodeLimits, TurnCodec, _Episode, _failed,
                                          _to_batch, room, step_one, take_reply, take_turn, turn_sampling)
from grpo_mega.rollout.types import RolloutBatch, SamplingConfig

__all__ = ["TurnEngine", "StepperTurns", "run_episodes_async"]

_IDLE_WAIT_S = 0.05
"""How long the driver waits for a tool call when the engine has nothing to step."""


class TurnEngine(Protocol):
    """An engine stepped one decoding step at a time, taking requests between steps."""

    logprobs_mode: str

    def add(self, key: int, ids: list[int], sampling: SamplingConfig, *, step: int, budget: int) -> None:
        """Queue one sample of ``ids`` (``sampling.n`` is 1), seeded by (``step``, ``key``),
        at most ``budget`` new tokens."""
        ...

    @property
    def busy(self) -> bool:
        """Requests in flight."""
        ...

    def step(self) -> list[tuple]:
        """One engine step; the requests it finished, as (key, token ids, log-probs, finish),
        or with a fifth item, the per-token policy versions, from an engine that stamps them
        (asynchronous GRPO: ``rollout.multi_turn_remote.RemoteTurns``)."""
        ...


class StepperTurns:
    """A :class:`TurnEngine` over an in-process ``RolloutEngine`` (its vLLM engine stepped by
    ``remote.stepwise.Stepper``, whose seeds are those of ``RolloutEngine.generate``)."""

    def __init__(self, engine):
        from grpo_mega.rollout.remote.stepwise import Stepper

        self.stepper, self.logprobs_mode = Stepper(engine), engine.logprobs_mode

    def add(self, key: int, ids: list[int], sampling: SamplingConfig, *, step: int, budget: int) -> None:
        self.stepper.add(str(key), [ids], sampling, step=step, keys=[key], budgets=[budget])

    @property
    def busy(self) -> bool:
        return self.stepper.busy

    def step(self) -> list[tuple[int, list[int], list[float], str]]:
        return [(int(ticket), list(b.response_ids[0]), list(b.logprobs[0]), b.finish_reasons[0])
                for ticket, b in self.stepper.step(0)]


def run_episodes_async(turns: TurnEngine, codec: TurnCodec, make_env: Callable[[], Environment],
                       rows: Sequence[dict], sampling: SamplingConfig, limits: EpisodeLimits, *, step: int,
                       offset: int = 0, keys: Optional[Sequence[int]] = None) -> RolloutBatch:
    """``sampling.n`` episodes for each of ``rows`` (prompt ``offset + i``), group-major, as
    ``multi_turn.run_episodes`` returns them; see the module docstring. ``keys``: each row's
    seed index (default ``offset + i``; asynchronous GRPO re-plays over-stale groups under
    their first keys). Turns that come back stamped keep their versions per token."""
    g, one = sampling.n, turn_sampling(sampling, codec)
    envs: dict[int, Environment] = {}
    episodes: list[_Episode] = []
    pool = ThreadPoolExecutor(max_workers=limits.env_workers, thread_name_prefix="env-step")
    running: dict[Future, tuple[_Episode, dict]] = {}
    start = time.perf_counter()

    def ask(e: _Episode) -> None:
        """Queue the episode's next turn, or end it when the turn would not fit."""
        left = room(e, limits)
        if left < 1:
            e.finish = "length"
            return
        turns.add(e.key, e.prompt_ids + e.ids, one, step=step * TURN_SEED_STRIDE + e.turns,
                  budget=min(left, one.max_new_tokens))

    def answer(e: _Episode, r: dict) -> None:
        take_reply(codec, e, r, limits)
        if e.finish is None:
            ask(e)

    def timed(env: Environment, message, clock: dict) -> dict:
        clock["started"] = time.monotonic()
        return step_one(env, message)

    try:
        for i, row in enumerate(rows):
            for j in range(g):
                key = (offset + i if keys is None else keys[i]) * g + j
                env = envs[key] = make_env()
                messages, tools = list(env.reset(row)), [t.schema() for t in env.tools]
                episodes.append(_Episode(key=key, prompt_index=offset + i, prompt_ids=codec.first_ids(messages, tools),
                                         messages=messages, tools=tools))
        by_key = {e.key: e for e in episodes}
        for e in episodes:
            ask(e)
        while turns.busy or running:
            for key, ids, lps, finish, *stamps in (turns.step() if turns.busy else []):
                e = by_key[key]
                take_turn(codec, e, ids, lps, finish, stamps[0] if stamps else None)
                if e.finish is not None:
                    continue
                if e.messages[-1].get("tool_calls"):  # a tool call: in a worker, while the engine steps
                    clock: dict = {}
                    running[pool.submit(timed, envs[key], e.messages[-1], clock)] = (e, clock)
                else:  # a final answer: scored here (a reward's timeout may need the main thread)
                    answer(e, step_one(envs[key], e.messages[-1]))
            if running and not turns.busy:  # nothing to generate: wait for the next tool call
                wait(list(running), timeout=_IDLE_WAIT_S, return_when=FIRST_COMPLETED)
            _collect(running, limits.step_timeout_seconds, answer)
        for e in episodes:
            if e.finish is None:
                e.finish = "turns"
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        for env in envs.values():
            env.close()
    return _to_batch(codec, episodes, g, time.perf_counter() - start, turns.logprobs_mode, limits.error_reward)


def _collect(running: dict, timeout: Optional[float], answer: Callable[[Any, dict], None]) -> None:
    """Hand finished tool calls to their episodes; end those past the per-step timeout (their
    threads are left to return; results ignored)."""
    now = time.monotonic()
    for f, (e, clock) in list(running.items()):
        if f.done():
            del running[f]
            answer(e, f.result())
        elif timeout is not None and "started" in clock and now >= clock["started"] + timeout:
            del running[f]
            answer(e, _failed(f"env.step outlasted env.step_timeout_seconds={timeout:g}"))
