"""Scoring a batch of samples with a weighted sum of reward functions, in worker processes.

:class:`RewardScorer` scores samples in a pool of worker processes, with a
per-sample timeout. A function that raises or times out is reported with the
sample's index and the exception. ``on_error="raise"`` (the default) stops the
run with a :class:`RewardError`; ``on_error="zero"`` scores the sample 0 and
counts it.

Why a process pool of our own rather than ``ProcessPoolExecutor``: a reward
stuck in an infinite loop must not hold a worker forever, so a worker that
overruns its deadline is killed and replaced; the executor cannot do that.
Workers are started with ``spawn`` (the trainer process holds threads and a
vLLM engine, which ``fork`` would copy in an undefined state); each resolves
its reward names again (registered names, or ``module:function`` imports).

The rollout adds two keys to each sample's metadata (copied, never mutated):
``response_length`` (tokens) and ``finish_reason`` ("stop" or "length"); the
length penalties read them.

A reward may return :class:`~grpo_mega.rewards.steps.StepScores` (process
supervision); ``RewardResult.steps`` then carries the weighted step scores.

Every value a reward returns, and every sample's weighted total, must be finite and within
``REWARD_BOUND`` (|r| <= 1e6): a larger one overflows the trainer's float32 batch (1e300
became inf and crashed the step) or swamps its group's statistics. One outside is a failure
of that reward on that sample, reported like a raise (prompt and sample index, function).
"""
from __future__ import annotations

import math
import os
import multiprocessing as mp
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Mapping, Sequence

from grpo_mega.runtime import lifeline
from grpo_mega.rewards.registry import RewardFn, RewardSpec, check_reward_kwargs, resolve_reward
from grpo_mega.rewards.steps import StepScores

__all__ = [
    "RewardSample", "RewardFailure", "RewardResult", "RewardError", "RewardScorer",
    "score_samples", "ON_ERROR_POLICIES", "REWARD_BOUND",
]

ON_ERROR_POLICIES = ("raise", "zero")

REWARD_BOUND = 1e6
"""Largest |reward| accepted, per reward function and for a sample's weighted total. Rewards
are scores of the order of 1; the bound leaves room for any sensible scale while keeping
squares and sums of a group (1e12 per term) exact enough in float64 and finite in float32."""


def _out_of_bounds(value: float) -> str:
    """Why ``value`` is not an acceptable reward, or ''."""
    if not math.isfinite(value):
        return f"returned non-finite value {value}"
    if abs(value) > REWARD_BOUND:
        return (f"returned {value:g}, outside the bound |reward| <= {REWARD_BOUND:g} "
                "(grpo_mega.rewards.REWARD_BOUND); rescale the reward")
    return ""


def _largest_total(specs: Sequence[RewardSpec], values: Sequence) -> float:
    """A sample's weighted total, or, with step scores (all terms then return them, on the
    same steps), a step's weighted total when it lies further from 0: each is a reward the
    advantages read."""
    totals = [sum(s.weight * (v.value if isinstance(v, StepScores) else v) for s, v in zip(specs, values))]
    if values and isinstance(values[0], StepScores):
        totals += [sum(s.weight * v.scores[j] for s, v in zip(specs, values)) for j in range(len(values[0].scores))]
    return max(totals, key=abs)


@dataclass
class RewardSample:
    prompt: str
    completion: str
    reference: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class RewardFailure:
    index: int
    """Index of the sample in the batch passed to ``score``."""
    kind: str
    """"error" (the function raised), "timeout" or "crash" (the worker died)."""
    reward: str | None
    message: str
    traceback: str = ""
    group_size: int = 1
    """G samples per prompt, contiguous in the batch: names the sample as (prompt, sample)."""

    def describe(self) -> str:
        where = f"reward {self.reward!r}" if self.reward else "reward"
        g = self.group_size
        sample = (f"prompt {self.index // g} sample {self.index % g} (batch index {self.index})"
                  if g > 1 else f"sample {self.index}")
        return f"{sample}: {where} {self.kind}: {self.message}"


@dataclass
class RewardResult:
    scores: list[float]
    """Total reward per sample: sum of weight * component."""
    components: dict[str, list[float]]
    """Unweighted value of each reward term, per sample (0 where it failed)."""
    failures: list[RewardFailure]
    seconds: float = 0.0
    steps: list[StepScores | None] = field(default_factory=list)
    """Per sample, the weighted sum of its terms' step scores when they returned
    :class:`StepScores` (None when they returned floats, or failed); ``scores`` then
    holds the weighted sum of their ``value``."""

    @property
    def num_errors(self) -> int:
        return sum(f.kind != "timeout" for f in self.failures)

    @property
    def num_timeouts(self) -> int:
        return sum(f.kind == "timeout" for f in self.failures)


class RewardError(RuntimeError):
    """A reward function raised or timed out and ``on_error="raise"``."""

    def __init__(self, failures: Sequence[RewardFailure]):
        self.failures = list(failures)
        lines = [f.describe() for f in self.failures[:5]]
        if len(self.failures) > 5:
            lines.append(f"... and {len(self.failures) - 5} more")
        detail = self.failures[0].traceback.strip()
        msg = (f"{len(self.failures)} reward failure(s):\n  " + "\n  ".join(lines)
               + ("\nfirst traceback:\n" + detail if detail else "")
               + "\n(set reward on_error='zero' to score such samples 0 and continue)")
        super().__init__(msg)


def _evaluate(specs: Sequence[RewardSpec], fns: Sequence[RewardFn], sample: RewardSample):
    """Run every reward on one sample: ("ok", values) or ("error", name, msg, tb)."""
    values = []
    for spec, fn in zip(specs, fns):
        try:
            value = fn(sample.prompt, sample.completion, sample.reference,
                       dict(sample.metadata), **dict(spec.kwargs))
            if isinstance(value, StepScores):
                value.check(len(sample.completion))
            else:
                value = float(value)
        except Exception as e:  # noqa: BLE001 - any user error is reported, not raised here
            return ("error", spec.name, f"{type(e).__name__}: {e}", traceback.format_exc())
        for v in value.scores if isinstance(value, StepScores) else (value,):
            if _out_of_bounds(v):
                return ("error", spec.name, _out_of_bounds(v), "")
        values.append(value)
    steps = [(s.name, v) for s, v in zip(specs, values) if isinstance(v, StepScores)]
    if steps:
        # One step layout per sample: the advantage needs a single set of step ends.
        floats = [s.name for s, v in zip(specs, values) if not isinstance(v, StepScores)]
        if floats:
            return ("error", floats[0], f"returned a float while {steps[0][0]!r} returned StepScores; "
                    "with step scores every reward term must return StepScores", "")
        odd = [n for n, v in steps if v.ends != steps[0][1].ends]
        if odd:
            return ("error", odd[0], f"returned step ends different from {steps[0][0]!r}'s; "
                    "reward terms must agree on the steps", "")
    return ("ok", values)


def _warm_up(specs: Sequence[RewardSpec], fns: Sequence[RewardFn]) -> None:
    for spec, fn in zip(specs, fns):
        warm = getattr(fn, "warm_up", None)
        if callable(warm):
            warm(**dict(spec.kwargs))


def _worker_main(conn: Connection, specs: Sequence[RewardSpec], parent: int) -> None:
    # A worker busy in a scorer never reads the pipe's EOF: without this it outlived a
    # rank killed by the OOM killer.
    lifeline.watch_parent("trainer rank", label="reward worker", expected_parent=parent)
    try:
        fns = [resolve_reward(s.name) for s in specs]
        _warm_up(specs, fns)
    except Exception as e:  # noqa: BLE001 - e.g. a custom module importable in the parent only
        conn.send(("fatal", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        index, sample = msg
        conn.send(("result", (index, _evaluate(specs, fns, sample))))


class _Worker:
    def __init__(self, ctx, specs: Sequence[RewardSpec]):
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, args=(child, list(specs), os.getpid()), daemon=True)
        self.proc.start()
        child.close()
        self.ready = False
        self.started = time.monotonic()
        self.task: tuple[int, float] | None = None  # (sample index, deadline)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(timeout=2)
        self.kill()


class RewardScorer:
    """Scores samples with a weighted sum of reward functions.

    ``num_workers=0`` evaluates in this process (for debugging: the timeout
    is then not enforced). Workers start on first use and live until
    :meth:`close` (also a context manager).
    """

    def __init__(self, rewards: Sequence[RewardSpec | str | Mapping[str, Any]], *,
                 num_workers: int = 2, timeout_s: float = 10.0, on_error: str = "raise",
                 mp_context: str = "spawn", group_size: int = 1):
        if not rewards:
            raise ValueError("RewardScorer needs at least one reward")
        if num_workers < 0 or group_size < 1:
            raise ValueError(f"RewardScorer needs num_workers >= 0 and group_size >= 1, got "
                             f"{num_workers} and {group_size} (--reward.num_workers, --rollout.n)")
        self.group_size = int(group_size)
        if on_error not in ON_ERROR_POLICIES:
            raise ValueError(f"reward on_error={on_error!r}; choose one of {ON_ERROR_POLICIES}")
        if timeout_s <= 0:
            raise ValueError(f"reward timeout_s must be > 0, got {timeout_s}")
        self.specs = [RewardSpec.coerce(r) for r in rewards]
        names = [s.name for s in self.specs]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate reward names {names}; give each term once")
        # Resolve here too, so a typo in the config fails before any rollout.
        self._fns = [resolve_reward(s.name) for s in self.specs]
        for spec, fn in zip(self.specs, self._fns):
            problem = check_reward_kwargs(fn, spec.kwargs)
            if problem:
                raise ValueError(f"reward {spec.name!r} kwargs {dict(spec.kwargs)}: {problem}")
        self._warmed_inline = False
        self.num_workers = int(num_workers)
        self.timeout_s = float(timeout_s)
        self.startup_timeout_s = 120.0
        self.on_error = on_error
        self._ctx = mp.get_context(mp_context)
        self._workers: list[_Worker] = []

    # -- lifecycle -------------------------------------------------------
    def _ensure_workers(self) -> None:
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker(self._ctx, self.specs))

    def close(self) -> None:
        for w in self._workers:
            w.stop()
        self._workers = []

    def __enter__(self) -> "RewardScorer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # best effort; close() is the contract
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass

    # -- scoring ---------------------------------------------------------
    def score(self, samples: Sequence[RewardSample]) -> RewardResult:
        start = time.perf_counter()
        outcomes = (self._score_inline(samples) if self.num_workers == 0
                    else self._score_in_pool(samples))
        result = self._assemble(outcomes, len(samples))
        result.seconds = time.perf_counter() - start
        if result.failures and self.on_error == "raise":
            raise RewardError(result.failures)
        return result

    def _score_inline(self, samples: Sequence[RewardSample]) -> dict[int, tuple]:
        if not self._warmed_inline:
            _warm_up(self.specs, self._fns)
            self._warmed_inline = True
        return {i: _evaluate(self.specs, self._fns, s) for i, s in enumerate(samples)}

    def _score_in_pool(self, samples: Sequence[RewardSample]) -> dict[int, tuple]:
        self._ensure_workers()
        pending = deque(range(len(samples)))
        outcomes: dict[int, tuple] = {}
        while pending or any(w.task for w in self._workers):
            for w in self._workers:
                if w.ready and w.task is None and pending:
                    i = pending.popleft()
                    w.conn.send((i, samples[i]))
                    # The clock starts when a ready worker gets the sample:
                    # process start-up (seconds under load) is not the reward's.
                    w.task = (i, time.monotonic() + self.timeout_s)
            waiting = [w for w in self._workers if w.task or not w.ready]
            deadlines = [w.task[1] if w.task else w.started + self.startup_timeout_s for w in waiting]
            ready = wait([w.conn for w in waiting], timeout=max(0.0, min(deadlines) - time.monotonic()))
            for w in waiting:
                if w.conn in ready:
                    self._receive(w, outcomes)
            self._expire(outcomes)
        return outcomes

    def _receive(self, w: _Worker, outcomes: dict[int, tuple]) -> None:
        try:
            kind, payload = w.conn.recv()
        except (EOFError, OSError):
            if not w.ready:
                raise RuntimeError(f"reward worker died while starting (exit code {w.proc.exitcode})")
            outcomes[w.task[0]] = ("crash", None, f"reward worker died (exit code {w.proc.exitcode})", "")
            self._replace(w)
            return
        if kind == "fatal":
            raise RuntimeError(f"reward worker could not load the reward functions: {payload}")
        if kind == "ready":
            w.ready = True
            return
        index, outcome = payload
        assert w.task is not None and index == w.task[0], (index, w.task)
        outcomes[index] = outcome
        w.task = None

    def _expire(self, outcomes: dict[int, tuple]) -> None:
        now = time.monotonic()
        for w in list(self._workers):
            if w.task and now >= w.task[1]:
                names = ", ".join(s.name for s in self.specs)
                outcomes[w.task[0]] = ("timeout", None,
                                       f"no result within {self.timeout_s:g} s (rewards: {names}); "
                                       "worker killed", "")
                self._replace(w)
            elif not w.ready and now >= w.started + self.startup_timeout_s:
                raise RuntimeError(f"reward worker did not start within {self.startup_timeout_s:g} s")

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self._workers[self._workers.index(w)] = _Worker(self._ctx, self.specs)

    def _assemble(self, outcomes: Mapping[int, tuple], n: int) -> RewardResult:
        components = {s.name: [0.0] * n for s in self.specs}
        scores = [0.0] * n
        steps: list[StepScores | None] = [None] * n
        failures = []
        for i in range(n):
            outcome = outcomes[i]
            if outcome[0] == "ok":
                total = _largest_total(self.specs, outcome[1])
                if _out_of_bounds(total):  # each term was within bounds; their weights were not
                    names = "+".join(f"{s.weight:g}*{s.name}" for s in self.specs)
                    outcome = ("error", None, f"weighted total {names} {_out_of_bounds(total)} "
                               "(--reward.weights)", "")
            if outcome[0] != "ok":
                kind, name, msg, tb = outcome
                failures.append(RewardFailure(i, kind, name, msg, tb, self.group_size))
                continue  # failed sample scores 0 (on_error="zero")
            step_scores = None
            for spec, value in zip(self.specs, outcome[1]):
                if isinstance(value, StepScores):
                    weighted = [spec.weight * v for v in value.scores]
                    step_scores = StepScores([a + b for a, b in zip(step_scores.scores, weighted)]
                                             if step_scores else weighted, value.ends)
                    value = value.value
                components[spec.name][i] = value
                scores[i] += spec.weight * value
            steps[i] = step_scores
        return RewardResult(scores, components, failures, steps=steps)


def score_samples(samples: Sequence[RewardSample],
                  rewards: Sequence[RewardSpec | str | Mapping[str, Any]], **kwargs) -> RewardResult:
    """One-shot convenience: build a scorer, score, close it."""
    with RewardScorer(rewards, **kwargs) as scorer:
        return scorer.score(samples)
