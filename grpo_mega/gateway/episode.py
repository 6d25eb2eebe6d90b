"""One episode's token-exact record: how a call's messages map onto recorded ids.

An episode is one conversation an agent holds through the gateway, and one sample of the
batch the trainer gets. Its trajectory is ``prompt_ids`` (the first call's messages
rendered with the generation prompt) followed by segments: the model's sampled ids (mask 1,
each with its log-prob) and the chat format's ids for what the agent added in between
(``codec.delta_ids``: separators, tool results, the next generation prompt; mask 0).

A later call must *extend* the recorded conversation: its messages are the recorded ones
(the assistant turns exactly as the gateway returned them) followed by new messages. Then
only the delta is rendered and appended; earlier turns are never re-tokenized (a
re-tokenized history can differ from what was sampled: BPE merges across the turn's
edges, byte sequences that do not round-trip, templates that re-render earlier turns
differently).

Cut points (``_Mark``) make two more cases token-exact, by truncation:

* a retry: the same messages as an earlier call (the openai client retries a call whose
  response was lost): the trajectory goes back to where that call started and is sampled
  again;
* a branch: new messages after an earlier assistant reply (the agent went back a few
  turns): the trajectory goes back to that reply.

A reply ended by one of the request's stop strings (a ReAct agent's ``Observation:``) has
no end-of-turn token: the agent gets its text without the stop string, as from OpenAI, and
its next call continues after the reply's ids (the stop string's included, as sampled)
with the end-of-turn token appended (mask 0, never trained on), then the delta: the ids
are what the model produced and what the chat format puts between turns, though the text
the agent sent back for that reply is shorter.

The dropped model tokens are counted (``rewinds``, ``dropped_model_tokens``). Anything
else, including a continuation of a reply that was cut by ``max_tokens`` (the model never
closed that turn, so no rendering of it matches its ids), is a :class:`Rewrite`; the
gateway refuses it or restarts the trajectory (``on_rewrite``).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Optional

from grpo_mega.envs.types import Message
from grpo_mega.gateway.openai_api import same_message, tools_key

__all__ = ["Episode", "Plan", "Rewrite"]


class Rewrite(Exception):
    """The call's messages do not extend the episode's recorded conversation."""


@dataclass(frozen=True, eq=False)  # compared by identity: two calls can begin at equal points
class _Mark:
    n_messages: int
    n_ids: int
    after_reply: bool  # True: right after a closed assistant reply; False: where a call began sampling
    needs_eot: bool = False  # after a reply ended by a stop string: its delta starts with the end-of-turn token


@dataclass
class Plan:
    """What a call will do to the episode, decided before the engine runs (nothing is
    committed until the sample comes back)."""

    messages: list[Message]          # the call's messages (normalised)
    tools: list[dict]
    restart: bool                    # a fresh trajectory (first call, or a restart)
    cut: Optional[_Mark] = None      # else: go back to this mark
    delta: list[int] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)   # restart only

    def engine_prompt(self, ep: "Episode") -> list[int]:
        """The ids the engine continues: everything recorded up to the cut, plus the delta."""
        if self.restart:
            return list(self.prompt_ids)
        return ep.prompt_ids + ep.ids[:self.cut.n_ids] + self.delta


class Episode:
    """The record of one episode (see the module docstring). Not thread-safe by itself:
    the gateway holds ``lock`` for a whole call."""

    def __init__(self, episode_id: str, serial: int, prompt_index: Optional[int] = None,
                 metadata: Optional[dict] = None):
        self.id, self.serial = episode_id, serial
        self.prompt_index, self.metadata = prompt_index, dict(metadata or {})
        self.lock = threading.Lock()
        self.tools: list[dict] = []
        self.prompt_ids: list[int] = []
        self.messages: list[Message] = []   # as the chat format renders them (assistant: as parsed)
        self.shown: list[Message] = []      # as the agent must send them back (assistant: as returned)
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.segments: list[tuple[str, list[int]]] = []
        self.cut: list[bool] = []           # per model segment: the reply did not end its turn
        self.marks: list[_Mark] = []
        self.reward: Optional[float] = None
        self.finished = False
        self.last_closed = True             # whether the last reply ended its turn
        self.calls = 0                      # calls served (successful)
        self.attempts = 0                   # calls that reached the engine (seed keys)
        self.rewinds = self.restarts = self.dropped_model_tokens = 0
        self.sampling_overridden = 0
        self.sampling_used: list[list[float]] = []
        self.logprobs_mode: Optional[str] = None
        self.seconds = 0.0
        self.text = ""
        self.task: Optional[dict] = None    # what the agent was handed (``open_episode(task=)``)
        self.error: Optional[str] = None    # why the trainer ended it (``Gateway.expire``)

    # -- deciding ------------------------------------------------------------
    def plan(self, codec, messages: list[Message], tools: list[dict]) -> Plan:
        """How the call's messages extend the record; raises :class:`Rewrite` (with the reason)."""
        if not self.prompt_ids:
            return self.plan_restart(codec, messages, tools)
        if tools_key(tools) != tools_key(self.tools):
            raise Rewrite("the call's tools differ from the episode's (the tool list is rendered into the "
                          "first prompt, so it must stay the same for the whole episode)")
        lcp = 0
        while lcp < min(len(messages), len(self.shown)) and same_message(messages[lcp], self.shown[lcp]):
            lcp += 1
        for mark in reversed(self.marks):
            n = mark.n_messages
            if n > lcp:
                continue
            if mark.after_reply and len(messages) > n:
                close = [codec.eot_id] if mark.needs_eot else []
                return Plan(messages, tools, restart=False, cut=mark,
                            delta=close + list(codec.delta_ids(self.messages[:n], messages[n:], tools)))
            if not mark.after_reply and len(messages) == n:
                return Plan(messages, tools, restart=False, cut=mark)
        if lcp == len(self.shown) and len(messages) == lcp:
            raise Rewrite("the messages end with the assistant's last reply and add nothing; append the "
                          "tool results or the user's next message")
        if lcp == len(self.shown) and not self.last_closed:
            raise Rewrite("the episode's last reply was cut (finish_reason 'length') "
                          "and cannot be continued token-exactly: the model never closed that turn")
        if lcp < len(messages) and lcp < len(self.shown):
            where = f"messages[{lcp}] ({messages[lcp]['role']}) differs from the episode's"
        else:
            where = f"the call has {len(messages)} messages, the episode's conversation {len(self.shown)}"
        raise Rewrite(f"the messages do not extend the episode's recorded conversation: {where} "
                      "(send back every earlier message, the assistant's replies exactly as returned)")

    def plan_restart(self, codec, messages: list[Message], tools: list[dict]) -> Plan:
        return Plan(messages, tools, restart=True, prompt_ids=list(codec.first_ids(messages, tools)))

    # -- committing ----------------------------------------------------------
    def commit(self, plan: Plan, ids: list[int], logprobs: list[float], parsed: Message, shown: Message,
               closed: bool, stopped: bool = False) -> None:
        """Record a served call: the cut or restart, the delta, the model's ids, the reply.
        ``closed``: the reply ends with the end-of-turn token; ``stopped``: it ended on a
        request's stop string instead (continued after the end-of-turn token, appended)."""
        if len(ids) != len(logprobs):
            raise ValueError(f"the engine returned {len(ids)} ids and {len(logprobs)} log-probs")
        if plan.restart:
            if self.prompt_ids:
                self.restarts += 1
                self.dropped_model_tokens += sum(self.mask)
            self.prompt_ids, self.tools = list(plan.prompt_ids), list(plan.tools)
            self.messages, self.shown = list(plan.messages), list(plan.messages)
            self.ids, self.mask, self.logprobs, self.segments, self.marks = [], [], [], [], []
            self.cut = []
        else:
            self._cut(plan.cut)
            new = plan.messages[plan.cut.n_messages:]
            self.messages += new
            self.shown += new
            self._add("env", plan.delta)
        self.marks.append(_Mark(len(self.messages), len(self.ids), after_reply=False))
        self._add("model", ids, logprobs)
        self.cut.append(not closed)
        self.messages.append(parsed)
        self.shown.append(shown)
        self.last_closed = closed or stopped
        if closed or stopped:
            self.marks.append(_Mark(len(self.messages), len(self.ids), after_reply=True, needs_eot=not closed))
        self.calls += 1
        self.text = str(shown.get("content") or "")

    def _add(self, kind: str, ids: list[int], logprobs: Optional[list[float]] = None) -> None:
        if not ids:
            return
        self.ids += ids
        self.mask += [1 if kind == "model" else 0] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)
        self.segments.append((kind, list(ids)))

    def _cut(self, mark: _Mark) -> None:
        """Go back to ``mark`` (a no-op when it is the latest point)."""
        if mark is self.marks[-1] and mark.n_ids == len(self.ids):
            return
        self.rewinds += 1
        self.dropped_model_tokens += sum(self.mask[mark.n_ids:])
        self.ids, self.mask, self.logprobs = (self.ids[:mark.n_ids], self.mask[:mark.n_ids],
                                              self.logprobs[:mark.n_ids])
        kept, total = [], 0
        for kind, seg in self.segments:
            if total + len(seg) > mark.n_ids:
                break
            kept.append((kind, seg))
            total += len(seg)
        assert total == mark.n_ids, "marks sit on segment boundaries"
        self.segments = kept
        self.cut = self.cut[:sum(1 for k, _ in kept if k == "model")]
        self.messages, self.shown = self.messages[:mark.n_messages], self.shown[:mark.n_messages]
        at = next(i for i, m in enumerate(self.marks) if m is mark)
        # A reply's mark stays (the new delta follows it); a call's start is marked again by commit.
        self.marks = self.marks[:at + 1] if mark.after_reply else self.marks[:at]
        self.last_closed = True  # an after-reply mark follows a closed reply; a call begins at the other

    # -- reading -------------------------------------------------------------
    def sample(self, codec) -> dict[str, Any]:
        """The episode as one sample: the fields of a ``RolloutBatch`` row."""
        problems = list(codec.check(self.prompt_ids, self.segments, self.messages, self.tools, self.ids,
                                    self.mask, self.cut))
        model = sum(self.mask)
        replies = [self.messages[m.n_messages] for m in self.marks if not m.after_reply]
        info = {"episode_id": self.id, "turns": len(replies),
                "tool_calls": sum(len(m.get("tool_calls") or []) for m in replies),
                "tool_errors": 0, "env_tokens": len(self.mask) - model, "token_mismatch": len(problems),
                "problems": problems[:3], "calls": self.calls, "rewinds": self.rewinds,
                "restarts": self.restarts, "dropped_model_tokens": self.dropped_model_tokens,
                "sampling": self.sampling_used, "sampling_overridden": self.sampling_overridden,
                "reward_reported": self.reward is not None, "metadata": self.metadata,
                "env_error": int(self.error is not None), "error": self.error}
        return {"prompt_ids": list(self.prompt_ids), "response_ids": list(self.ids),
                "logprobs": list(self.logprobs), "response_mask": list(self.mask),
                "finish_reason": "stop" if self.last_closed else "length", "text": self.text, "info": info}

    def summary(self) -> dict[str, Any]:
        """A JSON-able view (``GET /episodes/<id>``)."""
        return {"id": self.id, "prompt_index": self.prompt_index, "calls": self.calls, "finished": self.finished,
                "reward": self.reward, "messages": len(self.shown), "prompt_tokens": len(self.prompt_ids),
                "model_tokens": sum(self.mask), "env_tokens": len(self.mask) - sum(self.mask),
                "rewinds": self.rewinds, "restarts": self.restarts}
