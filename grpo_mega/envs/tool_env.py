"""A question-answer episode with tools: the base of the built-in environments.

:class:`ToolEnv` opens an episode with the row's prompt, answers every tool call of an
assistant turn with one ``{"role": "tool", "tool_call_id", "name", "content"}`` message
each, in the order of the calls (parallel calls included), and ends the episode when
the assistant answers without a tool call or has used ``max_turns`` turns. The final
message is then scored with reward functions of :mod:`grpo_mega.rewards` (by default
``math``: the final answer against the row's reference), so an environment reward is the
same function a single-turn run would use.

Nothing the model writes raises here: an unknown tool, arguments that are not JSON or do
not fit the tool's schema, and a tool function that raises each become an ``error: ...``
tool message the model reads next turn (:func:`call_tool`). Config and data mistakes
(a bad reward name, a row without a prompt) do raise, naming the field.

A subclass is a dataclass that sets ``tools`` in ``__post_init__`` (see
``calculator.py``); its fields are its config kwargs, with docstrings.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from grpo_mega.envs.types import Message, StepResult, Tool, ToolCall
from grpo_mega.rewards.registry import RewardSpec, check_reward_kwargs, resolve_reward

__all__ = ["ToolEnv", "call_tool", "check_arguments"]

_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
               "array": (list, tuple), "object": (dict,), "null": (type(None),)}


def check_arguments(schema: Mapping[str, Any], args: Mapping[str, Any]) -> str | None:
    """Why ``args`` does not fit a tool's JSON schema (a missing required argument, an
    unknown one, a wrong type), or None. A small subset of JSON schema: an object's
    ``properties``, ``required``, ``additionalProperties`` (false unless set: the function
    could not take an unknown keyword anyway) and each property's ``type``."""
    props = schema.get("properties", {})
    missing = [k for k in schema.get("required", []) if k not in args]
    if missing:
        return f"missing argument(s) {missing}"
    unknown = [k for k in args if k not in props]
    if unknown and not schema.get("additionalProperties", False):
        return f"unknown argument(s) {unknown}; arguments: {sorted(props)}"
    for k, v in args.items():
        want = props.get(k, {}).get("type")
        types = [want] if isinstance(want, str) else list(want or [])
        known = [t for t in types if t in _JSON_TYPES]
        if known and not any(isinstance(v, _JSON_TYPES[t]) and not (isinstance(v, bool) and t in ("integer", "number"))
                             for t in known):
            return f"argument {k!r} must be {' or '.join(known)}, got {type(v).__name__}"
    return None


def call_tool(tools: Mapping[str, Tool], call: ToolCall, fallback_id: str,
              max_chars: int = 8192) -> tuple[Message, bool]:
    """Answer one tool call: ``(tool message, whether it is an error)``. Never raises for
    what the call holds; the message's ``tool_call_id`` is the call's ``id`` (or
    ``fallback_id`` when the call has none), so the model can match results to calls."""
    fn = call.get("function") if isinstance(call, Mapping) else None
    fn = fn if isinstance(fn, Mapping) else {}
    name = fn.get("name")
    call_id = call.get("id") if isinstance(call, Mapping) and call.get("id") else fallback_id
    args = fn.get("arguments", {})
    error = None
    if not isinstance(name, str) or name not in tools:
        error = f"unknown tool {name!r}; available: {sorted(tools)}"
    elif isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            error = f"arguments of {name} are not valid JSON ({e.msg} at column {e.colno})"
    if error is None and not isinstance(args, Mapping):
        error = f"arguments of {name} must be a JSON object, got {type(args).__name__}"
    if error is None:
        problem = check_arguments(tools[name].parameters, args)
        if problem:
            error = f"bad arguments for {name}: {problem}"
    if error is None:
        try:
            content = str(tools[name].fn(**args))
        except Exception as e:  # noqa: BLE001 - a failing tool is the model's news, not the run's
            error = f"{name} failed: {type(e).__name__}: {e}"
    if error is not None:
        content = f"error: {error}"
    if len(content) > max_chars:
        content = content[:max_chars] + "\n[truncated]"
    return {"role": "tool", "tool_call_id": call_id, "name": name if isinstance(name, str) else "",
            "content": content}, error is not None


def _user_text(messages: Sequence[Message]) -> str:
    users = [m.get("content") or "" for m in messages if m.get("role") == "user"]
    return users[-1] if users else ""


@dataclass(eq=False)
class ToolEnv:
    """A prompt, tool turns, a scored final answer. Subclasses set ``self.tools``."""

    max_turns: int = 4
    """Assistant turns per episode; the last one ends the episode even if it calls a tool
    (its calls are then not answered, and its text is scored)."""
    reward: Any = "math"
    """Reward terms scoring the final assistant message against the row's reference: a
    name of ``grpo_mega.rewards`` (or ``module:function``), or a list of
    ``{name, weight, kwargs}`` like ``reward.functions``; the episode reward is their
    weighted sum, given on the last turn."""
    system_prompt: str | None = None
    """A system message put before the row's messages (none if the row starts with one)."""
    prompt_field: str = "prompt"
    """Row field with the prompt: a string (one user message) or a list of messages."""
    messages_field: str = "messages"
    """Row field read when ``prompt_field`` is absent: a list of chat messages."""
    reference_field: str = "answer"
    """Row field with the reference answer (may be absent if the rewards need none)."""
    max_tool_chars: int = 8192
    """A tool result longer than this is cut, with a note."""
    tools: list[Tool] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        specs = [self.reward] if isinstance(self.reward, (str, Mapping, RewardSpec)) else list(self.reward)
        self._rewards = [RewardSpec.coerce(s) for s in specs]
        self._reward_fns = [resolve_reward(s.name) for s in self._rewards]
        for spec, fn in zip(self._rewards, self._reward_fns):
            problem = check_reward_kwargs(fn, spec.kwargs)
            if problem:
                raise TypeError(f"reward {spec.name!r}: {problem} (fix its kwargs in the "
                                "environment's reward setting)")
        self._turn, self._reference, self._prompt, self._tool_calls, self._tool_errors = 0, None, "", 0, 0

    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        if self.prompt_field in row:
            prompt = row[self.prompt_field]
        elif self.messages_field in row:
            prompt = row[self.messages_field]
        else:
            raise KeyError(f"row has neither {self.prompt_field!r} nor {self.messages_field!r} "
                           f"(fields: {sorted(row)}); set the environment's prompt_field")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        if self.system_prompt is not None and (not messages or messages[0].get("role") != "system"):
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        ref = row.get(self.reference_field)
        self._turn, self._reference, self._prompt = 0, None if ref is None else str(ref), _user_text(messages)
        self._tool_calls = self._tool_errors = 0
        return messages

    def step(self, message: Message) -> StepResult:
        self._turn += 1
        calls = message.get("tool_calls") or []
        if not calls or self._turn >= self.max_turns:
            stop = "answer" if not calls else "max_turns"
            return StepResult([], self.score(message.get("content") or ""), True,
                              {"turn": self._turn, "stop": stop, "tool_calls": 0, "tool_errors": 0,
                               "unanswered_tool_calls": len(calls)})
        tools = {t.name: t for t in self.tools}
        results, errors = [], 0
        for i, call in enumerate(calls):
            msg, failed = call_tool(tools, call, f"call_{self._turn}_{i}", self.max_tool_chars)
            results.append(msg)
            errors += failed
        self._tool_calls += len(calls)
        self._tool_errors += errors
        return StepResult(results, 0.0, False, {"turn": self._turn, "tool_calls": len(calls), "tool_errors": errors})

    def score(self, final: str) -> float:
        """The weighted reward of the final assistant text (the reward functions' own
        errors, a missing reference for ``math`` say, propagate: they are config mistakes)."""
        meta = {"turns": self._turn, "tool_calls": self._tool_calls, "tool_errors": self._tool_errors}
        return float(sum(spec.weight * float(fn(self._prompt, final, self._reference, dict(meta), **dict(spec.kwargs)))
                         for spec, fn in zip(self._rewards, self._reward_fns)))

    def close(self) -> None:
        """Nothing held between calls (each tool call cleans up after itself)."""
