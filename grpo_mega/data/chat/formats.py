"""Chat formats: one :class:`ChatFormat` per template family, a registry keyed by name,
detection from a tokenizer's chat template, and the parsers of assistant turns.

A format knows what the template alone does not tell: the token that ends an assistant
turn (the engine's stop token, ``eot_token``), how to recognise the family's template
(``markers``), and how to read a sampled assistant turn back into a message
(``parse``: content, Qwen3's ``reasoning_content``, tool calls). Rendering itself is
always the tokenizer's own template (``grpo_mega.data.chat.tokens``).

Parsing rules, for every family:
* the text is the decoded generation, special tokens kept (``skip_special_tokens=False``:
  Mistral's ``[TOOL_CALLS]`` is a special token); a trailing end-of-turn/eos token is
  ignored;
* tool calls become ``{"id", "type": "function", "function": {"name", "arguments": dict}}``
  with ``arguments`` parsed from JSON; ids are the model's own where the format writes
  them (Mistral), else ``call_0``, ``call_1``, ... in the turn's order;
* all or nothing: if any call of a turn is malformed (bad JSON, no name, arguments not an
  object, an unclosed tag), the turn has NO tool calls and its whole text (after the
  reasoning) is the content. No exception: a malformed call is the model's mistake, for
  the environment to answer (usually as "no tool called"), not a crash of the rollout.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

Message = dict[str, Any]
"""An OpenAI-style chat message, as in ``grpo_mega.envs.types`` (not imported: data stays
below envs)."""

__all__ = ["ChatFormat", "ChatFormatError", "CHAT_FORMATS", "FORMAT_FLAG", "register_chat_format",
           "get_chat_format", "detect_chat_format", "resolve_chat_format", "hf_tokenizer"]

FORMAT_FLAG = "env.chat_format"
"""The config field that names a chat format explicitly (errors point at it)."""


class ChatFormatError(ValueError):
    """A chat format cannot be found, or the template breaks token-in/token-out."""


@dataclass(frozen=True)
class ChatFormat:
    """One template family."""

    name: str
    eot_token: str
    """Text of the single token that ends an assistant turn (the engine's stop token)."""
    markers: tuple[str, ...]
    """Strings that all occur in the family's chat template (detection)."""
    parse: Callable[[str], Message] = field(repr=False)
    """Sampled assistant text (special tokens kept, end-of-turn token stripped) -> message."""
    reasoning: bool = False
    """Whether turns may carry ``<think>`` reasoning (``reasoning_content``)."""

    def eot_id(self, tokenizer: Any) -> int:
        """The id of ``eot_token``; an error if the tokenizer splits it into several tokens."""
        hf = hf_tokenizer(tokenizer)
        ids = hf.encode(self.eot_token, add_special_tokens=False)
        if len(ids) != 1:
            raise ChatFormatError(
                f"chat format {self.name!r}: the end-of-turn token {self.eot_token!r} is {len(ids)} "
                f"tokens in {type(hf).__name__}, not one; the tokenizer does not belong to this "
                f"family (set {FORMAT_FLAG} to the right one) or lacks the family's special tokens")
        return int(ids[0])


CHAT_FORMATS: dict[str, ChatFormat] = {}
"""Registered formats by name; detection tries them in registration order."""


def register_chat_format(fmt: ChatFormat) -> ChatFormat:
    """Add ``fmt`` to :data:`CHAT_FORMATS` (a name may be registered once)."""
    if fmt.name in CHAT_FORMATS:
        raise ValueError(f"chat format {fmt.name!r} is already registered")
    CHAT_FORMATS[fmt.name] = fmt
    return fmt


def get_chat_format(name: str) -> ChatFormat:
    if name not in CHAT_FORMATS:
        raise ChatFormatError(f"{FORMAT_FLAG}={name!r} is not a chat format; choose one of "
                              f"{sorted(CHAT_FORMATS)}")
    return CHAT_FORMATS[name]


def hf_tokenizer(tokenizer: Any) -> Any:
    """The transformers tokenizer behind ``tokenizer`` (our ``HFTokenizer`` wraps one as ``.hf``)."""
    hf = getattr(tokenizer, "hf", tokenizer)
    if not hasattr(hf, "apply_chat_template"):
        raise ChatFormatError(f"{tokenizer!r} is not a Hugging Face tokenizer; multi-turn chat needs "
                              "one with a chat template (a tokenizer directory, model.hf_checkpoint)")
    return hf


def detect_chat_format(tokenizer: Any) -> ChatFormat:
    """The format whose markers all occur in the tokenizer's chat template."""
    hf = hf_tokenizer(tokenizer)
    template = getattr(hf, "chat_template", None)
    if not isinstance(template, str) or not template:
        raise ChatFormatError(f"tokenizer {getattr(hf, 'name_or_path', hf)!r} has no chat template "
                              f"(or several named ones); set {FORMAT_FLAG} to one of "
                              f"{sorted(CHAT_FORMATS)} and give the tokenizer a chat_template")
    for fmt in CHAT_FORMATS.values():
        if all(m in template for m in fmt.markers):
            return fmt
    raise ChatFormatError(f"cannot tell the chat format of tokenizer "
                          f"{getattr(hf, 'name_or_path', '')!r} from its chat template "
                          f"({template[:80]!r}...); set {FORMAT_FLAG} to one of {sorted(CHAT_FORMATS)}")


def resolve_chat_format(tokenizer: Any, fmt: ChatFormat | str | None) -> ChatFormat:
    """``fmt`` itself, the registered format of that name, or the detected one when None."""
    if isinstance(fmt, ChatFormat):
        return fmt
    return get_chat_format(fmt) if fmt is not None else detect_chat_format(tokenizer)


# ---------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------

class _Malformed(Exception):
    pass


def _call(i: int, obj: Any, args_key: str = "arguments") -> dict[str, Any]:
    """One ``{"name", args_key}`` JSON object -> an OpenAI tool call (raises _Malformed)."""
    if not isinstance(obj, Mapping) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise _Malformed
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):  # arguments written as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            raise _Malformed from None
    if not isinstance(args, Mapping):
        raise _Malformed
    call_id = obj.get("id") if isinstance(obj.get("id"), str) else f"call_{i}"
    return {"id": call_id, "type": "function", "function": {"name": obj["name"], "arguments": dict(args)}}


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise _Malformed from None


def _message(content: str, calls: list[dict] | None = None, reasoning: str | None = None) -> Message:
    msg: Message = {"role": "assistant", "content": content}
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    if calls:
        msg["tool_calls"] = calls
    return msg


def _strip_eot(text: str, *eots: str) -> str:
    for eot in eots:
        if text.endswith(eot):
            return text[: -len(eot)]
    return text


_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def _parse_hermes(text: str) -> tuple[str, list[dict]]:
    """Qwen's ``<tool_call>\\n{json}\\n</tool_call>`` blocks after the content."""
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    try:
        rest = text[start:]
        blocks = _TOOL_CALL.findall(rest)
        # Anything but whitespace between or after the blocks (an unclosed tag included).
        if not blocks or _TOOL_CALL.sub("", rest).strip():
            raise _Malformed
        calls = [_call(i, _loads(b.strip())) for i, b in enumerate(blocks)]
    except _Malformed:
        return text, []
    # The template writes "\n" between the content and the first call.
    return text[:start].removesuffix("\n"), calls


def parse_chatml(text: str) -> Message:
    content, calls = _parse_hermes(_strip_eot(text, "<|im_end|>", "<|endoftext|>"))
    return _message(content, calls)


def parse_qwen3(text: str) -> Message:
    """``<think>\\nreasoning\\n</think>\\n\\ncontent`` then hermes calls; an unclosed
    ``<think>`` (a turn cut by length) is all reasoning."""
    text = _strip_eot(text, "<|im_end|>", "<|endoftext|>")
    reasoning = None
    if "</think>" in text:
        head, text = text.split("</think>", 1)
        reasoning = head.split("<think>", 1)[-1].strip("\n")
        text = text.lstrip("\n")
    elif text.lstrip("\n").startswith("<think>"):
        return _message("", None, text.split("<think>", 1)[1].strip("\n"))
    content, calls = _parse_hermes(text)
    return _message(content, calls, reasoning)


def parse_llama3(text: str) -> Message:
    """A tool-call turn is only JSON objects ``{"name", "parameters"}`` joined by ``"; "``."""
    text = _strip_eot(text, "<|eot_id|>", "<|eom_id|>")
    body = text.strip()
    if not body.startswith("{"):
        return _message(text)
    try:
        dec, calls, pos = json.JSONDecoder(), [], 0
        while pos < len(body):
            obj, pos = dec.raw_decode(body, pos)
            calls.append(_call(len(calls), obj, "parameters"))
            rest = body[pos:].lstrip()
            if rest and not rest.startswith(";"):
                raise _Malformed
            pos = len(body) - len(rest.removeprefix(";").lstrip())
    except (_Malformed, json.JSONDecodeError):
        return _message(text)
    return _message("", calls)


def parse_mistral(text: str) -> Message:
    """Content, then ``[TOOL_CALLS]`` and a JSON list of ``{"name", "arguments", "id"}``."""
    text = _strip_eot(text, "</s>")
    content, sep, calls_text = text.partition("[TOOL_CALLS]")
    if not sep:
        return _message(text)
    try:
        objs = _loads(calls_text.strip())
        if not isinstance(objs, list) or not objs:
            raise _Malformed
        calls = [_call(i, o) for i, o in enumerate(objs)]
    except _Malformed:
        return _message(text)
    return _message(content, calls)


_TOOL_CODE = re.compile(r"```tool_code\n(.*?)\n```", re.S)


def parse_gemma(text: str) -> Message:
    """Content, then fenced ``tool_code`` blocks of ``{"name", "arguments"}`` JSON."""
    text = _strip_eot(text, "<end_of_turn>", "<eos>")
    start = text.find("```tool_code")
    if start < 0:
        return _message(text)
    rest = text[start:]
    try:
        blocks = _TOOL_CODE.findall(rest)
        if not blocks or _TOOL_CODE.sub("", rest).strip():
            raise _Malformed
        calls = [_call(i, _loads(b)) for i, b in enumerate(blocks)]
    except _Malformed:
        return _message(text)
    return _message(text[:start].removesuffix("\n"), calls)


# Registration order is detection order: Qwen3 (ChatML plus <think>) before ChatML.
register_chat_format(ChatFormat("qwen3", "<|im_end|>", ("<|im_start|>", "<think>"), parse_qwen3,
                                reasoning=True))
register_chat_format(ChatFormat("chatml", "<|im_end|>", ("<|im_start|>",), parse_chatml))
register_chat_format(ChatFormat("llama3", "<|eot_id|>", ("<|start_header_id|>", "<|eot_id|>"),
                                parse_llama3))
register_chat_format(ChatFormat("mistral", "</s>", ("[INST]", "[/INST]"), parse_mistral))
register_chat_format(ChatFormat("gemma", "<end_of_turn>", ("<start_of_turn>",), parse_gemma))
