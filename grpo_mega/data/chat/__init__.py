"""Chat formats for multi-turn, token-in/token-out episodes, and the token-exact invariant.

The multi-turn rollout never re-tokenizes a conversation. The engine generates an
assistant turn (ids ending with the family's end-of-turn token, or cut by a length
limit); the environment answers with messages; the driver appends the template's
rendering of those messages plus the next generation prompt, as ids. The trainer's
sequence is the concatenation of those pieces, so every model token keeps the id (and
the log-prob) it was sampled with.

API (``tokenizer``: our ``HFTokenizer`` or a transformers tokenizer with a chat template;
``messages``: OpenAI-style dicts, see ``grpo_mega.envs.types``; ``tools``: OpenAI tool
schemas or ``envs.Tool`` objects; ``fmt``: a :class:`ChatFormat`, its name, or None to
detect it from the template; ``template_kwargs``: extra template variables, e.g.
``{"enable_thinking": False}`` for Qwen3):

* ``detect_chat_format(tokenizer) -> ChatFormat``; ``get_chat_format(name)``;
  ``CHAT_FORMATS`` (registry: ``qwen3``, ``chatml``, ``llama3``, ``mistral``, ``gemma``;
  ``register_chat_format`` adds one). A template no format recognises is an error naming
  the config field ``env.chat_format`` (:data:`FORMAT_FLAG`).
* ``ChatFormat.eot_id(tokenizer) -> int``: the end-of-turn token (the engine's stop token).
* ``render_ids(tokenizer, messages, tools=None, add_generation_prompt=True, *,
  template_kwargs=None) -> list[int]``: the first prompt.
* ``turn_delta_ids(tokenizer, history_messages, new_messages, tools=None, *,
  truncated=False, fmt=None, template_kwargs=None) -> list[int]``: the ids to append right
  after the last generated token of an assistant turn: the separator the template writes
  after the end-of-turn token (ChatML's "\\n"), the rendered ``new_messages``, the next
  generation prompt. Cut from the template's renderings of a fixed dummy history, so it
  follows the real template; raises ``ChatFormatError`` if the template re-renders the
  earlier history once new messages follow. ``truncated=True`` (a turn cut by length):
  the delta starts with the end-of-turn token, appended and so not trainable.
* ``assistant_text(tokenizer, ids, fmt=None) -> str`` and ``parse_assistant(fmt_or_tokenizer,
  text) -> Message``: a sampled turn -> ``{"role": "assistant", "content",
  ["reasoning_content"], ["tool_calls"]}``; malformed tool calls stay content, never raise.
* ``check_trajectory(tokenizer, segments, messages, tools=None, *, token_ids=None,
  loss_mask=None, truncated=None, fmt=None, template_kwargs=None) -> list[str]``: the
  problems of one finished episode, empty when token-exact. ``segments`` is
  ``[first prompt, generated 1, appended 1, generated 2, ...]``.

What ``check_trajectory`` compares (cheap: a few template renders per episode):

* ids: ``token_ids`` (the trainer's sequence) equals the segments' concatenation, which
  catches a history re-tokenized from text (``encode(decode(ids)) != ids`` for non-canonical
  samples); ``loss_mask`` is 1 exactly on generated segments; a generated segment holds the
  end-of-turn token only as its last token (and, given ``truncated``, exactly when the
  engine did not stop at a length limit);
* (a) the first segment equals ``render_ids`` of the messages before the first assistant
  message, with the generation prompt;
* (b) each appended segment equals ``turn_delta_ids`` for the messages between its two
  assistant turns;
* (c) text: the decoded trajectory (special tokens kept; without a final generated segment)
  equals the template's rendering of the real conversation up to the next generation
  prompt, in which each assistant message is rendered as a placeholder and the placeholder
  is then replaced by what the model saw and sampled after the turn's header: the rest of
  the generation prompt (empty, but Qwen3's ``enable_thinking=False`` adds an empty think
  block) and the decoded ids that turn sampled (its end-of-turn token excluded, as the
  template writes that itself). So everything the template writes outside the model's
  own tokens (headers, separators, tool-result wrappers and their merging, generation
  prompts) must occur exactly once and in order, rendered with the real history rather
  than the dummy one (b) uses; a dropped or doubled separator at any boundary fails (c)
  even if ``turn_delta_ids`` itself had the bug. Assistant bodies are the model's and are
  not re-rendered: Qwen3's template drops earlier turns' reasoning when it re-renders
  history, but the sampled ``<think>`` text stays in the trajectory, and that is correct.

Reference templates and tiny local tokenizers per family: ``grpo_mega.data.chat.templates``.
Docs: docs/guides/multi-turn.md.
"""
from grpo_mega.data.chat.formats import (CHAT_FORMATS, FORMAT_FLAG, ChatFormat, ChatFormatError, Message,
                                         detect_chat_format, get_chat_format, register_chat_format,
                                         resolve_chat_format)
from grpo_mega.data.chat.tokens import (assistant_text, check_trajectory, parse_assistant, render_ids,
                                        turn_delta_ids, turn_delta_text)

__all__ = ["CHAT_FORMATS", "FORMAT_FLAG", "ChatFormat", "ChatFormatError", "Message", "assistant_text",
           "check_trajectory", "detect_chat_format", "get_chat_format", "parse_assistant",
           "register_chat_format", "render_ids", "resolve_chat_format", "turn_delta_ids",
           "turn_delta_text"]
