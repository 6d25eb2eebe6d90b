"""The OpenAI chat-completions wire format: request validation, message normalisation,
response and error shapes. Pure functions over JSON-decoded dicts (no HTTP, no engine).

A request that the gateway cannot serve exactly as asked is refused with a
:class:`GatewayError` (an HTTP status plus OpenAI's error body), never half-served: a
parameter that changes the sampling distribution (penalties, ``logit_bias``, forced tool
choice) would make the recorded log-probs belong to another distribution than the one the
trainer assumes, so it is a 400, not silently ignored.

Messages are normalised to the convention of ``grpo_mega.envs.types`` (what the chat
format renders): ``content`` a string, tool-call ``arguments`` a dict, ``developer``
read as ``system``. The same normal form is used to compare what an agent sends back with
what the gateway returned (``same_message``), so ``None`` vs ``""`` content, arguments as a
JSON string vs a dict, or extra null fields the openai client adds do not count as a
rewritten history.
"""
from __future__ import annotations

import json
import math
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from grpo_mega.envs.types import Message

__all__ = ["GatewayError", "ChatRequest", "parse_chat_request", "normalize_message", "same_message",
           "tools_key", "completion_response", "error_body", "models_response"]

ROLES = ("system", "developer", "user", "assistant", "tool")
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# Accepted and ignored: they change nothing the gateway records.
_IGNORED = {"model", "user", "metadata", "store", "parallel_tool_calls", "stream_options", "service_tier",
            "reasoning_effort", "prediction", "modalities", "safety_identifier", "prompt_cache_key"}
_KNOWN = _IGNORED | {"messages", "tools", "tool_choice", "temperature", "top_p", "top_k", "max_tokens",
                     "max_completion_tokens", "n", "seed", "stop", "stream", "logprobs", "top_logprobs",
                     "presence_penalty", "frequency_penalty", "logit_bias", "response_format",
                     "functions", "function_call"}


class GatewayError(Exception):
    """A request the gateway refuses: ``status`` (4xx/5xx) and OpenAI's error fields."""

    def __init__(self, status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_body(status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    kind = ("authentication_error" if status == 401 else "server_error" if status >= 500
            else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _bad(message: str, param: Optional[str] = None, code: str = "invalid_value") -> GatewayError:
    return GatewayError(400, message, param=param, code=code)


@dataclass
class ChatRequest:
    """One validated ``/chat/completions`` body (None: the gateway's default)."""

    messages: list[Message]
    tools: list[dict] = field(default_factory=list)
    tool_choice: str = "auto"
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    max_tokens: Optional[int] = None
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()


def _number(body: dict, key: str, lo: float, hi: float, *, lo_open: bool = False) -> Optional[float]:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or v < lo or v > hi or (lo_open and v == lo):
        side = "(" if lo_open else "["
        raise _bad(f"{key}={v!r} must be a number in {side}{lo}, {hi}]", key)
    return float(v)


def _int(body: dict, key: str, lo: int) -> Optional[int]:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise _bad(f"{key}={v!r} must be an integer >= {lo}", key)
    return v


def _unsupported(body: dict) -> None:
    unknown = sorted(set(body) - _KNOWN)
    if unknown:
        raise _bad(f"unsupported parameter(s) {unknown}; the gateway serves chat completions with "
                   f"messages, tools, tool_choice, temperature, top_p, max_tokens, seed and stop",
                   unknown[0], "unsupported_parameter")
    if body.get("stream"):
        raise _bad("stream=true is not supported by the gateway; call with stream=False", "stream",
                   "unsupported_parameter")
    if body.get("n") not in (None, 1):
        raise _bad(f"n={body.get('n')!r}: the gateway serves one choice per call (n=1); run one "
                   "episode per sample instead", "n", "unsupported_parameter")
    if body.get("logprobs") or body.get("top_logprobs"):
        raise _bad("logprobs/top_logprobs are not returned by the gateway (it records them for "
                   "training); leave them unset", "logprobs", "unsupported_parameter")
    for key in ("presence_penalty", "frequency_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise _bad(f"{key}={body[key]!r} changes the sampling distribution, which the recorded "
                       "log-probs must describe; leave it unset or 0", key, "unsupported_parameter")
    if body.get("logit_bias"):
        raise _bad("logit_bias changes the sampling distribution; leave it unset", "logit_bias",
                   "unsupported_parameter")
    fmt = body.get("response_format")
    if fmt not in (None, {"type": "text"}):
        raise _bad("response_format other than text is not supported", "response_format", "unsupported_parameter")
    if body.get("functions") is not None or body.get("function_call") is not None:
        raise _bad("the legacy functions/function_call API is not supported; pass tools", "functions",
                   "unsupported_parameter")


def parse_chat_request(body: Any) -> ChatRequest:
    """Validate a decoded JSON body; raises :class:`GatewayError` (400) naming the bad field."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    _unsupported(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list of chat messages", "messages", "missing_required_parameter"
                   if messages is None else "invalid_value")
    msgs = [normalize_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
    tools = _tools(body.get("tools"))
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto"
    if choice not in ("auto", "none"):
        raise _bad(f"tool_choice={choice!r}: the gateway supports 'auto' and 'none' (forcing a call "
                   "would need constrained decoding, which changes the sampled distribution)", "tool_choice",
                   "unsupported_parameter")
    max_tokens = _int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise _bad(f"stop={body.get('stop')!r} must be a string or a list of up to 4 non-empty strings", "stop")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not -2**63 <= seed < 2**63):
        raise _bad(f"seed={seed!r} must be a 64-bit integer", "seed")
    top_k = _int(body, "top_k", -1)
    return ChatRequest(messages=msgs, tools=tools, tool_choice=choice,
                       temperature=_number(body, "temperature", 0.0, 2.0),
                       top_p=_number(body, "top_p", 0.0, 1.0, lo_open=True),
                       top_k=None if top_k is None else max(top_k, 0),
                       max_tokens=max_tokens, seed=seed, stop=tuple(stop))


def _text(content: Any, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, p in enumerate(content):
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise _bad(f"{param}[{j}] is not a text part ({{'type': 'text', 'text': ...}}); the gateway "
                           "serves text only", f"{param}[{j}]")
            parts.append(p["text"])
        return "\n".join(parts)  # vLLM's "string" content format joins text parts so
    raise _bad(f"{param} must be a string, a list of text parts or null", param)


def _arguments(args: Any, param: str) -> Any:
    """A dict when ``args`` is (or encodes) a JSON object; otherwise the string as sent (a
    model may write arguments that are not JSON; the chat format renders them as they are)."""
    if isinstance(args, str):
        try:
            parsed = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return args
        return parsed if isinstance(parsed, dict) else args
    if not isinstance(args, dict):
        raise _bad(f"{param} must be a JSON object or a string", param)
    return args


def normalize_message(m: Any, param: str = "message") -> Message:
    """One client message in the ``envs.types`` normal form; 400 naming ``param`` if malformed."""
    if not isinstance(m, dict):
        raise _bad(f"{param} must be an object with a role", param)
    role = m.get("role")
    if role not in ROLES:
        raise _bad(f"{param}.role={role!r} is not one of {list(ROLES)}", f"{param}.role")
    if m.get("function_call") is not None:
        raise _bad(f"{param}.function_call (the legacy functions API) is not supported; use tool_calls",
                   f"{param}.function_call")
    out: Message = {"role": "system" if role == "developer" else role,
                    "content": _text(m.get("content"), f"{param}.content")}
    if isinstance(m.get("name"), str) and role != "tool":
        out["name"] = m["name"]
    if role == "assistant":
        calls = m.get("tool_calls") or []
        if not isinstance(calls, list):
            raise _bad(f"{param}.tool_calls must be a list", f"{param}.tool_calls")
        if calls:
            out["tool_calls"] = [_tool_call(c, f"{param}.tool_calls[{j}]") for j, c in enumerate(calls)]
        if isinstance(m.get("reasoning_content"), str) and m["reasoning_content"]:
            out["reasoning_content"] = m["reasoning_content"]
    if role == "tool":
        if not isinstance(m.get("tool_call_id"), str) or not m["tool_call_id"]:
            raise _bad(f"{param}.tool_call_id is required for a tool message", f"{param}.tool_call_id")
        out["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            out["name"] = m["name"]
    return out


def _tool_call(c: Any, param: str) -> dict:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise _bad(f"{param} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}", param)
    call_id = c.get("id")
    if not isinstance(call_id, str) or not call_id:
        raise _bad(f"{param}.id is required", f"{param}.id")
    return {"id": call_id, "type": "function",
            "function": {"name": fn["name"], "arguments": _arguments(fn.get("arguments", {}),
                                                                     f"{param}.function.arguments")}}


def _tools(tools: Any) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise _bad("tools must be a list of function tools", "tools")
    names = set()
    for i, t in enumerate(tools):
        p = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise _bad(f"{p} must be {{'type': 'function', 'function': {{'name', 'description', "
                       "'parameters'}}}}", p)
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise _bad(f"{p}.function.name={name!r} must be 1-64 letters, digits, '_' or '-'", f"{p}.function.name")
        if name in names:
            raise _bad(f"{p}.function.name={name!r} is used by two tools", f"{p}.function.name")
        names.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise _bad(f"{p}.function.description must be a string", f"{p}.function.description")
        params = fn.get("parameters")
        if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
            raise _bad(f"{p}.function.parameters must be a JSON schema object ({{'type': 'object', "
                       "'properties': ...}})", f"{p}.function.parameters")
    return tools


def tools_key(tools: list[dict]) -> str:
    """A canonical form of the tool list: the episode's tools must stay the same."""
    return json.dumps(tools, sort_keys=True, separators=(",", ":"))


def _comparable(m: Message) -> tuple:
    calls = tuple((c["id"], c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
                  for c in m.get("tool_calls") or [])
    return (m["role"], m.get("content") or "", calls, m.get("tool_call_id"), m.get("name"))


def same_message(a: Message, b: Message) -> bool:
    """Whether two normalised messages are the same turn (reasoning is not compared: an
    agent may drop it from an assistant turn it sends back, the model's tokens keep it)."""
    return _comparable(a) == _comparable(b)


def completion_response(model: str, message: Message, finish_reason: str, prompt_tokens: int,
                        completion_tokens: int) -> dict:
    """An OpenAI ``chat.completion`` object with one choice."""
    wire: dict[str, Any] = {"role": "assistant", "content": message.get("content") or None}
    if message.get("tool_calls"):
        wire["tool_calls"] = [{"id": c["id"], "type": "function",
                               "function": {"name": c["function"]["name"],
                                            "arguments": _wire_arguments(c["function"]["arguments"])}}
                              for c in message["tool_calls"]]
    elif wire["content"] is None:
        wire["content"] = ""
    if message.get("reasoning_content"):
        wire["reasoning_content"] = message["reasoning_content"]  # vLLM's field for it
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "system_fingerprint": None,
            "choices": [{"index": 0, "message": wire, "finish_reason": finish_reason, "logprobs": None}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def _wire_arguments(args: Any) -> str:
    return args if isinstance(args, str) else json.dumps(args)


def models_response(model: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created,
                                        "owned_by": "grpo-mega"}]}
