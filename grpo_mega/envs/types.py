"""The environment protocol: what a multi-turn, tool-using episode talks to.

An episode is a conversation of OpenAI-style messages. The environment opens it
(``reset(row)`` -> the first messages, usually system + user), then answers every
assistant turn (``step(message)`` -> the messages to append, a reward, and whether the
episode is over). Tools are Python functions with a JSON-schema signature; the chat
template is given their schemas (``Tool.schema``) so the model sees them as tools.

The shape follows what the peers converged on (SkyRL's ``BaseTextEnv.step`` ->
observations/reward/done, TRL's environment factory, verl's tool schemas), with one
difference: ``step`` takes the *parsed* assistant message (content and tool calls), not
text, because parsing a turn is the chat format's job (``grpo_mega.data.chat``) and the
same environment then serves every template family.

Messages are plain dicts, so they travel between ranks and over the gateway as JSON:
``{"role": "system"|"user"|"assistant"|"tool", "content": str, "tool_calls": [...],
"tool_call_id": str, "name": str, "reasoning_content": str}`` (only ``role`` and
``content`` required). A tool call is ``{"id": str, "type": "function", "function":
{"name": str, "arguments": dict | str}}``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, runtime_checkable

__all__ = ["Message", "ToolCall", "StepResult", "Tool", "Environment"]

Message = dict[str, Any]
"""An OpenAI-style chat message (see the module docstring)."""
ToolCall = dict[str, Any]
"""``{"id", "type": "function", "function": {"name", "arguments"}}``."""


@dataclass
class StepResult:
    """An environment's answer to one assistant turn."""

    messages: list[Message] = field(default_factory=list)
    """Messages appended after the assistant's (tool results, a user's reply); empty when done."""
    reward: float = 0.0
    """This turn's reward; the episode's reward is the sum over its turns."""
    done: bool = False
    """True ends the episode (no further assistant turn is generated)."""
    info: dict[str, Any] = field(default_factory=dict)
    """Free-form facts for metrics (JSON-able), e.g. ``{"tool_errors": 1}``."""


@dataclass(frozen=True)
class Tool:
    """A Python function offered to the model as a tool."""

    name: str
    description: str
    parameters: Mapping[str, Any]
    """JSON schema of the arguments (``{"type": "object", "properties": ..., "required": [...]}``)."""
    fn: Callable[..., str]
    """Called with the parsed arguments as keywords; returns the text the model reads."""

    def schema(self) -> dict[str, Any]:
        """The OpenAI function-tool form chat templates take in ``tools=``."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": dict(self.parameters)}}


@runtime_checkable
class Environment(Protocol):
    """One episode's world. A fresh instance (or a ``reset``) per episode; not shared
    between episodes running side by side."""

    tools: list[Tool]
    """Tools the model may call in this environment (may be empty)."""

    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        """Start an episode for one data row; returns its first messages."""
        ...

    def step(self, message: Message) -> StepResult:
        """Answer the assistant's message (``role == "assistant"``, parsed tool calls)."""
        ...

    def close(self) -> None:
        """Release what the episode holds (sandbox processes, temp dirs)."""
        ...
