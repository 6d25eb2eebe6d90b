"""Asynchronous GRPO: the rollout pipeline (``algorithm.max_staleness`` S with
``rollout.placement: separate``).

What: the engines run in their own processes (``grpo_mega.rollout.remote``) and keep
generating while the trainer updates. The pipeline keeps the prompt batches of the next
S + 1 steps submitted: after the weight sync that ends step k (policy version k) it submits
step k + S + 1's prompts, and step k + 1 takes its batch, which the engines started at
version k - S or later. A weight update reaches the engines while requests are in flight;
they pause, load, verify and go on, and every sampled token records the version that drew
it (``RolloutBatch.versions``).

Guarantees, and how:

* **Strict per-token bound.** A group with any token older than ``current - S`` (current =
  the version the update starts from, step - 1) is never trained: ``take`` re-samples its
  prompt at once with the current weights (drop-and-refill; the step keeps its prompts).
  The submission depth makes this impossible in normal running, so the count
  (``staleness/violations``) is 0 by construction and checked again before the update.
* **Exactly-once prompts across a kill.** A checkpoint stores the data position *before*
  the oldest batch still in flight (``data_state``), not the position after the newest
  draw, so a resumed run draws the in-flight prompts again and samples them anew with the
  restored weights (their in-flight samples died with the job). No prompt is skipped,
  none is trained twice; ``prompts.jsonl`` in the run directory records each step's prompt
  uids so the accounting can be checked.
* **S = 0** never builds a pipeline with colocated engines: the loop is today's code.
* **Multi-turn episodes** (``env.name``): a ticket is whole episodes, played against the
  engines while the trainer updates (``rollout.multi_turn_remote``); a weight update can land
  between two turns of an episode or inside one, and every turn's tokens keep the version
  that sampled them, so the bound above holds per token across turns (the environment's
  tokens are never trained and never count). Past it the whole group is dropped and played
  again on the current weights, as for single-turn: masking only the stale turns would
  still train the later turns on a reward the stale ones earned, and a partial group would
  move the others' advantages.
* **DAPO dynamic sampling** (``algorithm.dynamic_sampling``): a step that needs more groups
  with a reward spread takes the *next* draws in flight (``take(.., round=r)``), and draws
  one on the current weights when none is left; draws are consumed in the order they were
  drawn, so the checkpointed position (before the oldest draw in flight) still covers
  every prompt exactly once, dropped groups included (they were consumed, not skipped).
  A draw taken early is younger than its step's bound, never older.

Liveness: while global rank 0 collects (and re-samples over-stale groups), every other rank
waits in one collective (``run_on_src``) under the collective timeout
(``parallel.timeout_minutes``). So rank 0's whole collection of a step shares one deadline,
``collect_budget_seconds`` (``COLLECT_SHARE`` of that timeout, the rest a margin for
submitting, the staleness split and the broadcast): an engine that died, hangs or is merely
slow raises on rank 0 naming the engine before the collective could time out, and every
other rank gets that same error instead of a bare collective timeout (when the collect and
the re-sample each had the whole timeout, a slow but healthy engine ended the run with a
collective timeout).
"""
from __future__ import annotations

import dataclasses
import json
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch.distributed as dist

from grpo_mega.config import mini_batches_per_step
from grpo_mega.distributed.errors import run_on_src
from grpo_mega.runtime.faults import fault_point
from grpo_mega.rollout.layout import prompt_slice
from grpo_mega.rollout.types import RolloutBatch

if TYPE_CHECKING:
    from grpo_mega.data import Prompt
    from grpo_mega.rollout import SamplingConfig
    from grpo_mega.trainer.trainer import Trainer


COLLECT_SHARE = 0.8
"""The share of the collective timeout rank 0 may spend collecting one step's samples."""


def collect_budget_seconds(cfg) -> float:
    """Seconds rank 0 may spend collecting one step (collect and re-sample together): below
    the waiting ranks' collective timeout by a margin, so the named engine error comes first."""
    return COLLECT_SHARE * cfg.parallel.timeout_minutes * 60


@dataclass
class InFlight:
    """One draw of ``data.prompts_per_step`` prompts, submitted to the engines and not yet
    consumed by a step."""

    step: int
    """The step it was drawn for (its samples' seeds); a DAPO step may consume later ones."""
    prompts: list[Prompt]
    data_before: dict
    """The dataset position before these prompts were drawn (what a checkpoint stores)."""
    ticket: Any = None
    """The engines' handle for the request (global rank 0 only)."""
    sampling: Any = None
    """Its sampling when not the engines' default (a DAPO round drawn on demand)."""


def rollout_source(t: Trainer) -> Any:
    """What rank 0 submits to and collects from: the engines, or with ``env.name`` the
    episodes played against them (``trainer.episodes.episode_source``)."""
    if t.episodes is None:
        return t.engine
    from grpo_mega.trainer.episodes import episode_source
    return episode_source(t)


def _on_rank0(t: Trainer, fn, what: str):
    """``fn()`` on global rank 0, its result (or its error) on every rank."""
    return run_on_src(fn, 0, None, what) if t.ps.world_size == 1 else run_on_src(fn, 0, dist.group.WORLD, what)


def generate_separate(t: Trainer, prompts: list[Prompt], step: int,
                      sampling: Optional[SamplingConfig] = None, mini_batches: int = 1) -> RolloutBatch:
    """Synchronous generation on separate engines (evaluation, re-sampling): rank 0 submits
    and collects, every rank gets the global batch and keeps its DP replica's share
    (``prompt_slice``)."""
    timeout = collect_budget_seconds(t.cfg)

    def run() -> dict:
        engine = rollout_source(t)
        return engine.collect(engine.submit(prompts, sampling, step=step), timeout_s=timeout).to_dict()

    whole = RolloutBatch.from_dict(_on_rank0(t, run, f"generation of step {step}"))
    return prompt_slice(whole, len(prompts), t.ps.dp_rank, t.ps.dp, mini_batches)


class RolloutPipeline:
    """The batches of the next ``depth`` = S + 1 steps, submitted ahead of the update."""

    def __init__(self, max_staleness: int):
        self.max_staleness = max_staleness
        self.depth = max_staleness + 1
        self.queue: deque[InFlight] = deque()
        self.next_label = 0
        """The step label the next draw gets at least (labels only grow: a DAPO step that took
        later draws must not see their seeds reused)."""
        self.metrics: dict[str, float] = {}
        """The staleness metrics of the current step's draws so far (every rank)."""
        self._counts: list[dict] = []

    # ------------------------------------------------------------------ submit

    def _submit(self, t: Trainer, step: int, sampling: Any = None) -> None:
        """Draw the next prompts (every rank: the data cursor moves in step) and submit them
        (rank 0) under step label ``step``."""
        before = t.dataset.state_dict()
        prompts = t.dataset.next_batch(t.cfg.data.prompts_per_step)
        item = InFlight(step, prompts, before, sampling=sampling)
        fault_point("async.submit")
        if t.ps.rank == 0:
            engine = rollout_source(t)
            item.ticket = engine.submit(prompts, sampling, step=step)
        self.queue.append(item)
        self.next_label = max(self.next_label, step + 1)

    def fill(self, t: Trainer, next_step: int, last_step: int) -> None:
        """Keep the draws of steps ``next_step .. next_step + S`` (at most ``last_step``) in
        flight. Call right after a weight sync, so they start on it."""
        want = min(self.depth, last_step - next_step + 1)
        while len(self.queue) < want:
            self._submit(t, max(next_step, self.next_label))

    def data_state(self, t: Trainer) -> dict:
        """The data position a checkpoint stores: before the oldest untrained batch."""
        return self.queue[0].data_before if self.queue else t.dataset.state_dict()

    # -------------------------------------------------------------------- take

    def take(self, t: Trainer, step: int, round: int = 0) -> tuple[list[Prompt], RolloutBatch, dict[str, float]]:
        """Step ``step``'s next draw: its prompts and this DP replica's samples (over-stale
        groups already re-sampled), with the staleness metrics of the step's draws so far
        (also in ``self.metrics``). ``round`` > 0: a DAPO round, the next draw in flight, or
        one drawn now on the current weights (its seeds shifted by ``round``, as the
        synchronous loop's) when none is."""
        if round and not self.queue:
            s = t.engine.sampling
            self._submit(t, step, None if s.seed is None else dataclasses.replace(s, seed=s.seed + round))
        front = self.queue[0].step if self.queue else None
        own = not round and not t.cfg.algorithm.dynamic_sampling  # one draw per step: its own
        if front is None or front < step or (own and front != step):
            have = [i.step for i in self.queue]
            raise RuntimeError(f"async pipeline out of order: step {step} wants its batch, in flight: {have}")
        item = self.queue.popleft()
        current = step - 1  # the policy version the update of this step starts from

        def collect() -> tuple[dict, dict]:
            deadline = time.monotonic() + collect_budget_seconds(t.cfg)  # collect + re-sample
            if not round:
                fault_point("async.collect")
            engine = rollout_source(t)
            batch = engine.collect(item.ticket, timeout_s=deadline - time.monotonic())
            batch, counts = self._within_bound(t, batch, item, current, deadline)
            return batch.to_dict(), counts

        whole, counts = _on_rank0(t, collect, f"collecting the rollouts of step {step}")
        whole = RolloutBatch.from_dict(whole)
        self._counts = [*(self._counts if round else []), counts]
        from grpo_mega.trainer.staleness import StalenessStats
        self.metrics = StalenessStats.combine([StalenessStats(**c) for c in self._counts]).metrics()
        self._record(t, step, round, item.prompts)
        share = prompt_slice(whole, len(item.prompts), t.ps.dp_rank, t.ps.dp, mini_batches_per_step(t.cfg))
        return item.prompts, share, dict(self.metrics)

    def _within_bound(self, t: Trainer, batch: RolloutBatch, item: InFlight, current: int,
                      deadline: float) -> tuple[RolloutBatch, dict]:
        """Drop the over-stale groups and sample their prompts again with the newest weights
        (same step label, sampling and prompt keys, so the same seeds), by ``deadline``
        (``time.monotonic``: what is left of the step's collect budget); then the guard: no
        token past the bound reaches the update. Returns the batch and its staleness counts
        (``StalenessStats`` fields). Rank 0 only."""
        from grpo_mega.trainer.staleness import StalenessStats, check_bound, split_over_stale

        prompts, step, engine = item.prompts, item.step, rollout_source(t)
        split = split_over_stale(batch, current, self.max_staleness)
        parts, counts = [split.kept], [split.stats]
        if split.resample:
            redo = engine.collect(engine.submit([prompts[i] for i in split.resample], item.sampling, step=step,
                                                keys=split.resample),
                                  timeout_s=max(deadline - time.monotonic(), 0.0))
            redo.prompt_index = [split.resample[i] for i in redo.prompt_index]  # back to this batch's
            again = split_over_stale(redo, current, self.max_staleness)
            parts.append(again.kept)
            counts.append(again.stats)
            if again.resample:  # sampled on the current weights: cannot be stale, unless the engine lies
                raise RuntimeError(f"step {step}: prompts {again.resample} sampled again on policy version "
                                   f"{current} came back older than the bound")
        whole = RolloutBatch.concat(parts) if len(parts) > 1 else parts[0]
        # Group-major in prompt order again, as a synchronous batch (the DP deal cuts by prompt).
        order = sorted(range(len(whole)), key=lambda i: (whole.prompt_index[i], i))
        whole = whole.take(order)
        check_bound(whole, current, self.max_staleness)
        return whole, dataclasses.asdict(StalenessStats.combine(counts))

    def update_metrics(self, t: Trainer) -> dict[str, float]:
        """The last weight update as the engines saw it (global rank 0, which logs):
        ``engine_paused_s`` (slowest engine, first bucket to resume: its requests waited this
        long) and ``engine_load_s`` (of that, loading into vLLM)."""
        updates = getattr(t.engine, "updates", None) if t.ps.rank == 0 else None
        if not updates:
            return {}
        engines = updates[-1]["engines"]
        return {"engine_paused_s": max(e.get("paused_s", 0.0) for e in engines),
                "engine_load_s": max(e.get("load_s", 0.0) for e in engines)}

    def _record(self, t: Trainer, step: int, round: int, prompts: list[Prompt]) -> None:
        """``prompts.jsonl``: the uids of each draw a step consumes, ``round`` 0 first and
        DAPO's further rounds after it (the exactly-once accounting; a resumed run records
        the steps it redoes again)."""
        if t.ps.rank == 0:
            path = Path(t.cfg.logging.run_dir) / "prompts.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as f:
                f.write(json.dumps({"step": step, "round": round, "uids": [p.uid for p in prompts]}) + "\n")
