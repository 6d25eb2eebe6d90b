"""One engine thread: calls from agents running side by side share generate batches.

The HTTP server answers each call on its own thread; the engine (vLLM in this process) is
driven by exactly one thread, this one. It takes the calls waiting (up to ``max_batch``,
after ``wait_s`` for more to arrive), groups them by sampling settings and step, and makes
one ``generate`` call per group, so G agents of a GRPO group cost one engine call per turn
rather than G. A group whose generate call fails is retried call by call, so one bad
request cannot fail the others batched with it.

Pumped (``generate=None``): no thread; the trainer takes the waiting calls (``take``) on its
own thread and serves them with generate calls collective over its ranks
(``trainer.gateway``), and between its rollouts nothing drives the engine: calls wait in
the queue while the weights change.
"""
from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from grpo_mega.rollout.types import SamplingConfig

__all__ = ["Batcher", "Job", "Sampled", "by_sampling", "sampled"]

log = logging.getLogger(__name__)


@dataclass
class Sampled:
    """One call's generation, as the engine returned it."""

    ids: list[int]
    logprobs: list[float]
    finish: str                 # "stop" | "length"
    stop_reason: Any            # the stop string or stop token id, else None
    text: str
    logprobs_mode: str
    seconds: float              # this call's share of its generate call


@dataclass
class Job:
    prompt: list[int]
    sampling: SamplingConfig
    step: int
    key: int
    budget: int
    future: Future = field(default_factory=Future)


def by_sampling(jobs: list[Job]) -> list[list[Job]]:
    """The jobs in groups of one sampling and step (one generate call each), in order."""
    groups: dict[tuple, list[Job]] = {}
    for job in jobs:
        groups.setdefault((job.sampling, job.step), []).append(job)
    return list(groups.values())


def sampled(out: Any, i: int, share: float) -> Sampled:
    """Sample ``i`` of a ``RolloutBatch`` as one call's ``Sampled``."""
    return Sampled(ids=list(out.response_ids[i]), logprobs=list(out.logprobs[i]), finish=out.finish_reasons[i],
                   stop_reason=out.stop_reasons[i] if out.stop_reasons else None,
                   text=out.texts[i] if out.texts else "", logprobs_mode=out.logprobs_mode, seconds=share)


class Batcher:
    """Feeds ``generate(prompts, sampling, step=, keys=, budgets=) -> RolloutBatch`` (the
    engine's signature, ``RolloutEngine.generate``) from one thread; ``generate=None``:
    pumped by the caller (``take``)."""

    def __init__(self, generate: Optional[Callable[..., Any]], *, max_batch: int = 64, wait_s: float = 0.005):
        self.generate, self.max_batch, self.wait_s = generate, max_batch, wait_s
        self._queue: queue.Queue[Optional[Job]] = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._closed = False
        self.calls = 0  # generate calls made (a test reads it: agents side by side share them)

    def submit(self, job: Job) -> Future:
        with self._lock:
            if self._closed:
                raise RuntimeError("the gateway is closed")
            if self._thread is None and self.generate is not None:
                self._thread = threading.Thread(target=self._loop, name="gateway-engine", daemon=True)
                self._thread.start()
        self._queue.put(job)
        return job.future

    def close(self) -> None:
        """Serve what was submitted (pumped: fail it), then stop; later submissions raise."""
        with self._lock:
            self._closed = True
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()
        if self.generate is None:
            for job in self.take(0.0, limit=None):
                job.future.set_exception(RuntimeError("the gateway is closed"))

    def take(self, timeout: float, limit: Optional[int] = -1) -> list[Job]:
        """Pumped: the calls waiting (after up to ``timeout`` s for the first, ``wait_s`` for
        more; at most ``max_batch``, or all with ``limit=None``); [] when none came."""
        try:
            first = self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()
        except queue.Empty:
            return []
        jobs, _ = self._gather(first, self.max_batch if limit == -1 else limit)
        return jobs

    def _gather(self, first: Job, limit: Optional[int]) -> tuple[list[Job], bool]:
        jobs, stop = [first], False
        while limit is None or len(jobs) < limit:
            try:
                job = self._queue.get(timeout=self.wait_s)
            except queue.Empty:
                break
            if job is None:
                stop = True
                break
            jobs.append(job)
        return jobs, stop

    def _loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            jobs, stop = self._gather(first, self.max_batch)
            self._serve(jobs)
            if stop:
                return

    def _serve(self, jobs: list[Job]) -> None:
        for group in by_sampling(jobs):
            self._run(group)

    def _run(self, jobs: list[Job]) -> None:
        try:
            self.calls += 1
            out = self.generate([j.prompt for j in jobs], jobs[0].sampling, step=jobs[0].step,
                                keys=[j.key for j in jobs], budgets=[j.budget for j in jobs])
            if len(out.response_ids) != len(jobs):
                raise RuntimeError(f"the engine returned {len(out.response_ids)} samples for {len(jobs)} "
                                   "prompts (the gateway asks n=1)")
        except BaseException as e:  # noqa: BLE001 - handed to the waiting calls
            if len(jobs) == 1:
                jobs[0].future.set_exception(e)
                return
            log.warning("gateway: a batch of %d calls failed (%s); retrying them one by one", len(jobs), e)
            for j in jobs:
                self._run([j])
            return
        share = out.seconds / len(jobs)
        for i, j in enumerate(jobs):
            j.future.set_result(sampled(out, i, share))
