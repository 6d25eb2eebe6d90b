"""One engine thread: calls from agents running side by side share generate batches.

The HTTP server answers each call on its own thread; the engine (vLLM in this process) is
driven by exactly one thread, this one. It takes the calls waiting (up to ``max_batch``,
after ``wait_s`` for more to arrive), groups them by sampling settings and step, and makes
one ``generate`` call per group, so G agents of a GRPO group cost one engine call per turn
rather than G. A group whose generate call fails is retried call by call, so one bad
request cannot fail the others batched with it.
"""
from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from grpo_mega.rollout.types import SamplingConfig

__all__ = ["Batcher", "Job", "Sampled"]

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


class Batcher:
    """Feeds ``generate(prompts, sampling, step=, keys=, budgets=) -> RolloutBatch`` (the
    engine's signature, ``RolloutEngine.generate``) from one thread."""

    def __init__(self, generate: Callable[..., Any], *, max_batch: int = 64, wait_s: float = 0.005):
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
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="gateway-engine", daemon=True)
                self._thread.start()
        self._queue.put(job)
        return job.future

    def close(self) -> None:
        """Serve what was submitted, then stop; later submissions raise."""
        with self._lock:
            self._closed = True
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()

    def _loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            jobs, stop = [first], False
            while len(jobs) < self.max_batch:
                try:
                    job = self._queue.get(timeout=self.wait_s)
                except queue.Empty:
                    break
                if job is None:
                    stop = True
                    break
                jobs.append(job)
            groups: dict[tuple, list[Job]] = {}
            for job in jobs:
                groups.setdefault((job.sampling, job.step), []).append(job)
            for group in groups.values():
                self._run(group)
            if stop:
                return

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
            j.future.set_result(Sampled(
                ids=list(out.response_ids[i]), logprobs=list(out.logprobs[i]), finish=out.finish_reasons[i],
                stop_reason=out.stop_reasons[i] if out.stop_reasons else None,
                text=out.texts[i] if out.texts else "", logprobs_mode=out.logprobs_mode, seconds=share))
