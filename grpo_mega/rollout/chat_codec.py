"""The chat format as the episode driver and the gateway use it (a ``TurnCodec``).

A thin binding of ``grpo_mega.data.chat`` (render, delta, parse, check) to one tokenizer
and one format, so ``rollout.multi_turn`` and ``grpo_mega.gateway`` speak in ids and
messages only. ``format_name`` is a registered chat format, ``"auto"`` (detected from
the tokenizer's chat template) or ``"package.module:ATTR"`` naming a ``ChatFormat``
(imported and registered on use, e.g. the tool demo's ``grpo_mega.demo.tools:DEMO_FORMAT``).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from grpo_mega.data import chat
from grpo_mega.common.qualified import import_qualified

__all__ = ["ChatCodec", "load_chat_format"]


def load_chat_format(tokenizer: Any, format_name: Optional[str]) -> "chat.ChatFormat":
    """The ``ChatFormat`` ``format_name`` names (see the module docstring)."""
    if format_name in (None, "", "auto"):
        return chat.detect_chat_format(tokenizer)
    if ":" in format_name:
        try:
            fmt = import_qualified(format_name, f"{chat.FORMAT_FLAG}={format_name!r}", "attribute")
        except (ImportError, AttributeError) as e:
            raise chat.ChatFormatError(f"{chat.FORMAT_FLAG}={format_name!r}: cannot load it ({e})") from e
        if not isinstance(fmt, chat.ChatFormat):
            raise chat.ChatFormatError(f"{chat.FORMAT_FLAG}={format_name!r} is a {type(fmt).__name__}, "
                                       "not a ChatFormat")
        return fmt
    return chat.get_chat_format(format_name)


class ChatCodec:
    """``TurnCodec`` (``rollout.multi_turn``) for one tokenizer and chat format."""

    def __init__(self, tokenizer: Any, fmt: "chat.ChatFormat", template_kwargs: Optional[dict] = None):
        self.tokenizer, self.fmt = tokenizer, fmt
        self.template_kwargs = dict(template_kwargs or {})
        self.eot_id = fmt.eot_id(tokenizer)
        """The end-of-turn token: the engine must stop there (``stop_token_ids``)."""

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, format_name: Optional[str] = "auto",
                      template_kwargs: Optional[dict] = None) -> "ChatCodec":
        return cls(tokenizer, load_chat_format(tokenizer, format_name), template_kwargs)

    def first_ids(self, messages: list[dict], tools: list[dict]) -> list[int]:
        return chat.render_ids(self.tokenizer, messages, tools or None, True,
                               template_kwargs=self.template_kwargs)

    def delta_ids(self, history: list[dict], new: list[dict], tools: list[dict]) -> list[int]:
        return chat.turn_delta_ids(self.tokenizer, history, new, tools or None, fmt=self.fmt,
                                   template_kwargs=self.template_kwargs)

    def parse(self, ids: Sequence[int]) -> dict:
        return chat.parse_assistant(self.fmt, chat.assistant_text(self.tokenizer, ids, self.fmt))

    def check(self, prompt_ids: list[int], segments: list[tuple[str, list[int]]], messages: list[dict],
              tools: list[dict], response_ids: list[int], response_mask: list[int],
              truncated: list[bool]) -> list[str]:
        segs = [list(prompt_ids)] + [list(ids) for _, ids in segments]
        return chat.check_trajectory(self.tokenizer, segs, messages, tools or None,
                                     token_ids=list(prompt_ids) + list(response_ids),
                                     loss_mask=[0] * len(prompt_ids) + list(response_mask), truncated=truncated,
                                     fmt=self.fmt, template_kwargs=self.template_kwargs)
