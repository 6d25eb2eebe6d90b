"""vLLM driven one engine step at a time, each generated token tagged with the policy version
that sampled it.

Why stepwise: between two ``LLMEngine.step()`` calls the engine server can pause, load new
weights in place and resume, with every request and its KV cache kept (the KV of tokens
computed before an update stays as the old weights made it; prefix caching is off so no
*new* request reuses it). ``llm.generate`` would run every request to the end first.

Requests: one vLLM request per sample, ``n = 1``, seed ``request_seed(seed, step, key, n) +
j`` for sample j: exactly the seeds vLLM's own fan-out gives ``RolloutEngine.generate``'s
``n``-sample requests, so both front ends draw the same tokens. Outputs arrive as deltas
(``RequestOutputKind.DELTA``): each step's new tokens, their logprobs and text, tagged with
the version passed to :meth:`Stepper.step`.

Results have ``RolloutEngine.generate``'s fields and order (group-major: sample
``g * n + j`` is prompt g's j-th), plus ``versions`` ([tokens] per sample).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from grpo_mega.rollout.samples import check_budgets, request_seed, sampled_logprobs
from grpo_mega.rollout.types import RolloutBatch, SamplingConfig

__all__ = ["Stepper"]


@dataclass
class _Sample:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: Any = None


@dataclass
class _Ticket:
    prompts: list[list[int]]
    n: int
    offset: int
    started: float
    samples: dict[tuple[int, int], _Sample]
    open: int
    """Samples not finished yet."""


class Stepper:
    """The generation side of an engine server.

    engine: an in-process ``RolloutEngine`` (its ``llm.llm_engine`` is stepped here; its
    ``_sampling_params`` builds the vLLM parameters, so sampling equals the in-process path).
    """

    def __init__(self, engine):
        self.engine = engine
        self.llm_engine = engine.llm.llm_engine
        self.tickets: dict[str, _Ticket] = {}
        self.steps = 0
        self.tokens = 0

    def add(self, ticket: str, prompts: Sequence[Sequence[int]], s: SamplingConfig, *, step: int,
            offset: int = 0, keys: Sequence[int] | None = None,
            budgets: Sequence[int] | None = None) -> None:
        """Queue ``s.n`` samples of each prompt under ``ticket``. ``keys``: each prompt's seed
        index (default ``offset + i``, its index in the caller's whole batch); ``budgets``:
        each prompt's max_new_tokens (default ``s.max_new_tokens``)."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if ticket in self.tickets:
            raise ValueError(f"ticket {ticket!r} is already in flight")
        ids = [list(p) for p in prompts]
        budgets = [s.max_new_tokens] * len(ids) if budgets is None else list(budgets)
        keys = [offset + i for i in range(len(ids))] if keys is None else list(keys)
        check_budgets(ids, budgets, self.llm_engine.model_config.max_model_len, offset, s.max_new_tokens)
        one = dataclasses.replace(s, n=1)
        t = _Ticket(ids, s.n, offset, time.perf_counter(), {}, len(ids) * s.n)
        self.tickets[ticket] = t
        for i, p in enumerate(ids):
            seed = request_seed(s.seed, step, keys[i], s.n)
            for j in range(s.n):
                params = self.engine._sampling_params(one, None if seed is None else seed + j, budgets[i])
                params.output_kind = RequestOutputKind.DELTA
                t.samples[(i, j)] = _Sample()
                self.llm_engine.add_request(f"{ticket}|{i}|{j}", TokensPrompt(prompt_token_ids=p), params)

    @property
    def busy(self) -> bool:
        return bool(self.tickets)

    def step(self, version: int) -> list[tuple[str, RolloutBatch]]:
        """One engine step; every token it produced is tagged ``version``. Returns the
        tickets that finished in it, as (ticket, batch)."""
        outputs = self.llm_engine.step()
        self.steps += 1
        done = []
        for out in outputs:
            ticket, i, j = out.request_id.rsplit("|", 2)
            t = self.tickets[ticket]
            sample = t.samples[(int(i), int(j))]
            c = out.outputs[0]
            new = list(c.token_ids)
            if new:
                sample.tokens += new
                sample.logprobs += sampled_logprobs(c)
                sample.versions += [version] * len(new)
                self.tokens += len(new)
            sample.text += c.text
            if out.finished:
                sample.finish_reason, sample.stop_reason = str(c.finish_reason), c.stop_reason
                t.open -= 1
                if t.open == 0:
                    done.append((ticket, self._batch(self.tickets.pop(ticket))))
        return done

    def _batch(self, t: _Ticket) -> RolloutBatch:
        batch = RolloutBatch(prompt_ids=[], response_ids=[], logprobs=[], finish_reasons=[],
                             prompt_index=[], group_size=t.n, logprobs_mode=self.engine.logprobs_mode,
                             seconds=time.perf_counter() - t.started)
        for i, p in enumerate(t.prompts):
            for j in range(t.n):
                smp = t.samples[(i, j)]
                batch.prompt_ids.append(list(p))
                batch.response_ids.append(smp.tokens)
                batch.logprobs.append(smp.logprobs)
                batch.finish_reasons.append(smp.finish_reason)
                batch.stop_reasons.append(smp.stop_reason)
                batch.texts.append(smp.text)
                batch.prompt_index.append(t.offset + i)
                batch.versions.append(smp.versions)
        return batch
