"""Multi-turn episodes on engine servers (``env.name`` with ``rollout.placement: separate``,
asynchronous GRPO).

What: :class:`RemoteEpisodes` gives the trainer's rollout pipeline the same
``submit``/``done``/``collect`` as ``RemoteEngines``, but a ticket is whole episodes: each
ticket plays its rows in a background thread of the controller's process with the
asynchronous driver (``multi_turn_async.run_episodes_async``: each episode advances on its
own, tool calls in a bounded pool), one engine request per turn (:class:`RemoteTurns`).
Meanwhile the trainer updates and syncs: a weight update reaches the engines between two
turns or inside one, so an episode can span several policy versions. Every turn's tokens
come back stamped with the version that sampled them (the engine servers stamp each
decoding step, ``stepwise.Stepper``), and the episode keeps them per token across turns
(``multi_turn._Episode.versions``); the environment's tokens are never trained (mask 0).
The trainer's staleness bound is then per token across turns (``trainer.staleness``).

Why a thread in the controller's process, not the engine servers: environments and rewards
are the trainer's code and config (``env.*``), built where the trainer built them; the
servers stay a plain token-in/token-out engine.

Seeds: turn t of an episode draws with the key ``step * TURN_SEED_STRIDE + t`` and the
episode's key, as the in-process drivers do. An episode's turns all go to one engine
(``key % E``), spreading the episodes over the engines.

Liveness: a dead engine fails the episode thread's next wait naming it (``RemoteEngines``),
and :meth:`RemoteEpisodes.collect` re-raises that error; episodes unfinished at the caller's
deadline are cancelled (their thread stops at its next turn) and the call fails naming the
step. Reward functions run on the episode thread, so a reward's ``signal.alarm`` timeout is
not available there (``rewards.math`` then relies on its own bounds).
"""
from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from grpo_mega.envs.types import Environment
from grpo_mega.rollout.multi_turn import EpisodeLimits, TurnCodec
from grpo_mega.rollout.multi_turn_async import run_episodes_async
from grpo_mega.rollout.remote.launch import RemoteEngineError
from grpo_mega.rollout.types import RolloutBatch, SamplingConfig

__all__ = ["RemoteTurns", "RemoteEpisodes"]

POLL_S = 0.05
"""How long one :meth:`RemoteTurns.step` waits for a turn to come back."""


class EpisodesCancelled(RuntimeError):
    """The episodes' caller gave up on them (its deadline passed)."""


class RemoteTurns:
    """A ``multi_turn_async.TurnEngine`` over ``RemoteEngines``: each turn one request of one
    sample, on the episode's engine; finished turns come back with their per-token versions."""

    def __init__(self, engines, cancelled: Optional[threading.Event] = None):
        self.engines, self.logprobs_mode = engines, engines.logprobs_mode
        self.cancelled = cancelled or threading.Event()
        self.pending: dict[int, int] = {}
        """Ticket -> episode key."""

    def add(self, key: int, ids: list[int], sampling: SamplingConfig, *, step: int, budget: int) -> None:
        ticket = self.engines.submit([ids], sampling, step=step, keys=[key], budgets=[budget], engine=key)
        self.pending[ticket] = key

    @property
    def busy(self) -> bool:
        return bool(self.pending)

    def step(self) -> list[tuple[int, list[int], list[float], str, list[int]]]:
        """The turns that came back within ``POLL_S``, as (key, ids, log-probs, finish, versions)."""
        if self.cancelled.is_set():
            raise EpisodesCancelled("episodes cancelled by their caller")
        out = []
        for ticket in self.engines.wait_any(list(self.pending), POLL_S):
            key = self.pending.pop(ticket)
            b = self.engines.collect(ticket)  # done: returns at once
            out.append((key, list(b.response_ids[0]), list(b.logprobs[0]), b.finish_reasons[0],
                        list(b.versions[0])))
        return out


@dataclass
class _Job:
    step: int
    thread: Optional[threading.Thread] = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    batch: Optional[RolloutBatch] = None
    error: Optional[BaseException] = None


class RemoteEpisodes:
    """Episodes as tickets (see the module docstring).

    Args:
        engines: the ``RemoteEngines`` (global rank 0's).
        codec, make_env, limits: as ``multi_turn.run_episodes``'s.
        to_row: a submitted prompt -> the environment's row (``env.reset`` reads it).
    """

    def __init__(self, engines, codec: TurnCodec, make_env: Callable[[], Environment], limits: EpisodeLimits,
                 to_row: Callable[[Any], dict] = dict):
        self.engines, self.codec, self.make_env, self.limits, self.to_row = engines, codec, make_env, limits, to_row
        self._ids = itertools.count()
        self._jobs: dict[int, _Job] = {}

    @property
    def sampling(self) -> SamplingConfig:
        return self.engines.sampling

    def submit(self, prompts: Sequence[Any], sampling: Optional[SamplingConfig] = None, *, step: int,
               keys: Optional[Sequence[int]] = None) -> int:
        """Start ``sampling.n`` episodes of each prompt (prompt index i, seed key ``keys[i]``,
        default i) in a background thread; returns a ticket for :meth:`collect`."""
        rows = [self.to_row(p) for p in prompts]
        s = sampling or self.engines.sampling
        job = _Job(step)

        def play() -> None:
            try:
                job.batch = run_episodes_async(RemoteTurns(self.engines, job.cancelled), self.codec, self.make_env,
                                               rows, s, self.limits, step=step, keys=keys)
            except BaseException as err:  # noqa: BLE001 - handed to collect, which raises it
                job.error = err

        job.thread = threading.Thread(target=play, name=f"grpo-episodes-{step}", daemon=True)
        ticket = next(self._ids)
        self._jobs[ticket] = job
        job.thread.start()
        return ticket

    def done(self, ticket: int) -> bool:
        return not self._jobs[ticket].thread.is_alive()

    def collect(self, ticket: int, timeout_s: Optional[float] = None) -> RolloutBatch:
        """The ticket's episodes (group-major, ``versions`` per token); raises the episode
        thread's error (a dead engine's ``RemoteEngineError`` names it), or
        ``RemoteEngineError`` when they are unfinished after ``timeout_s``."""
        job = self._jobs[ticket]
        start = time.monotonic()
        job.thread.join(timeout_s)
        if job.thread.is_alive():
            job.cancelled.set()
            del self._jobs[ticket]
            raise RemoteEngineError(f"the episodes of step {job.step} did not finish within "
                                    f"{time.monotonic() - start:.0f} s on the engines")
        del self._jobs[ticket]
        if job.error is not None:
            raise job.error
        return job.batch

    def close(self) -> None:
        """Cancel the episodes still running (their threads stop at their next turn)."""
        for job in self._jobs.values():
            job.cancelled.set()
