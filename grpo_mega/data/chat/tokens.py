"""Token-in/token-out rendering and the token-exact invariant.

An episode's ids are built once and never re-tokenized: the first prompt
(:func:`render_ids`), then per turn the ids the engine sampled and the ids appended for
the environment's answer (:func:`turn_delta_ids`). :func:`check_trajectory` verifies a
finished episode against the tokenizer's chat template; see the package docstring
(``grpo_mega.data.chat``) for exactly what it compares.
"""
from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

from grpo_mega.data.chat.formats import (ChatFormat, ChatFormatError, FORMAT_FLAG, Message, hf_tokenizer,
                                         resolve_chat_format)

__all__ = ["render_ids", "turn_delta_ids", "turn_delta_text", "assistant_text", "parse_assistant",
           "check_trajectory"]

# The fixed history the delta of a turn is cut from (verl/SkyRL style). Its assistant turn
# stands for the model's: the delta is what the template writes after that turn's
# end-of-turn token.
_DUMMY_USER: Message = {"role": "user", "content": "Hi."}
_DUMMY_ASSISTANT: Message = {"role": "assistant", "content": "Done."}
_PLACEHOLDER = "<<grpo_mega:assistant:{}>>"
_PLACEHOLDER_RE = re.compile(r"<<grpo_mega:assistant:(\d+)>>")


def _schemas(tools: Sequence[Any] | None) -> list[dict] | None:
    """OpenAI tool schemas; ``grpo_mega.envs.Tool`` objects are converted with ``.schema()``."""
    if not tools:
        return None
    return [t.schema() if hasattr(t, "schema") else dict(t) for t in tools]


def _render(hf: Any, messages: Sequence[Message], tools: list[dict] | None, add_generation_prompt: bool,
            template_kwargs: Mapping[str, Any] | None) -> str:
    try:
        text = hf.apply_chat_template(list(messages), tools=tools, add_generation_prompt=add_generation_prompt,
                                      tokenize=False, **dict(template_kwargs or {}))
    except Exception as e:  # jinja2's TemplateError, a raise_exception() in the template
        roles = [m.get("role") for m in messages]
        raise ChatFormatError(f"the chat template failed to render messages with roles {roles}: {e}") from e
    if not isinstance(text, str):
        raise ChatFormatError(f"apply_chat_template returned {type(text).__name__}, not text; the "
                              "tokenizer may hold several named templates")
    return text


def _encode(hf: Any, text: str) -> list[int]:
    # The template writes bos itself; add_special_tokens=True would add a second one.
    return list(hf.encode(text, add_special_tokens=False))


def render_ids(tokenizer: Any, messages: Sequence[Message], tools: Sequence[Any] | None = None,
               add_generation_prompt: bool = True, *,
               template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """The ids of the template's rendering of ``messages`` (the episode's first prompt)."""
    hf = hf_tokenizer(tokenizer)
    return _encode(hf, _render(hf, messages, _schemas(tools), add_generation_prompt, template_kwargs))


def turn_delta_text(tokenizer: Any, new_messages: Sequence[Message], tools: Sequence[Any] | None = None, *,
                    fmt: ChatFormat | str | None = None,
                    template_kwargs: Mapping[str, Any] | None = None) -> str:
    """The template's text after an assistant turn's end-of-turn token: separator, the
    rendered ``new_messages`` and the next generation prompt.

    Cut from renderings of a fixed history (user, assistant) without and with the new
    messages. Raises :class:`ChatFormatError` if the template renders the history before
    that assistant turn differently once the new messages follow (the delta would then not
    continue the ids already sampled). The assistant turn itself may render differently
    (Qwen3 drops reasoning from turns before the last user query): its ids are the model's.
    """
    hf, fmt = hf_tokenizer(tokenizer), resolve_chat_format(tokenizer, fmt)
    schemas = _schemas(tools)
    # The history before the assistant turn; not its generation prompt, which may hold more
    # than the header the template writes for a finished turn (Qwen3's enable_thinking=False
    # adds an empty think block).
    prefix = _render(hf, [_DUMMY_USER], schemas, False, template_kwargs)
    full = _render(hf, [_DUMMY_USER, _DUMMY_ASSISTANT, *new_messages], schemas, True, template_kwargs)
    if not full.startswith(prefix):
        at = next((i for i, (a, b) in enumerate(zip(prefix, full)) if a != b), min(len(prefix), len(full)))
        raise ChatFormatError(
            f"chat format {fmt.name!r}: the template renders the conversation before the last "
            f"assistant turn differently once messages with roles {[m.get('role') for m in new_messages]} "
            f"follow (first difference at character {at}: {prefix[at:at + 40]!r} became "
            f"{full[at:at + 40]!r}), so appending ids turn by turn cannot match it; use a template "
            "that renders history the same whatever follows")
    end = full.find(fmt.eot_token, len(prefix))
    if end < 0 or not full[len(prefix):end].endswith(_DUMMY_ASSISTANT["content"]):
        raise ChatFormatError(
            f"chat format {fmt.name!r}: an assistant turn does not end with {fmt.eot_token!r} right "
            f"after its content in this template ({full[len(prefix):len(prefix) + 80]!r}); set "
            f"{FORMAT_FLAG} to the family of the tokenizer's template")
    return full[end + len(fmt.eot_token):]


def turn_delta_ids(tokenizer: Any, history_messages: Sequence[Message], new_messages: Sequence[Message],
                   tools: Sequence[Any] | None = None, *, truncated: bool = False,
                   fmt: ChatFormat | str | None = None,
                   template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """Ids to append right after the model's last generated token of an assistant turn.

    ``history_messages``: the conversation so far, ending with that assistant turn (only
    checked: the delta is cut from a fixed history, see :func:`turn_delta_text`).
    ``truncated``: the turn was cut by a length limit, so it lacks the end-of-turn token;
    the delta then starts with that token (appended, not generated: outside the loss mask).
    All returned ids are the environment's, none trainable.
    """
    if not history_messages or history_messages[-1].get("role") != "assistant":
        roles = [m.get("role") for m in history_messages]
        raise ChatFormatError(f"turn_delta_ids: history_messages must end with the assistant turn "
                              f"just generated; roles are {roles}")
    hf, fmt = hf_tokenizer(tokenizer), resolve_chat_format(tokenizer, fmt)
    text = turn_delta_text(hf, new_messages, tools, fmt=fmt, template_kwargs=template_kwargs)
    return ([fmt.eot_id(hf)] if truncated else []) + _encode(hf, text)


def assistant_text(tokenizer: Any, ids: Sequence[int], fmt: ChatFormat | str | None = None) -> str:
    """A generated turn's text with special tokens kept and the end-of-turn token dropped
    (what :func:`parse_assistant` reads)."""
    hf, fmt = hf_tokenizer(tokenizer), resolve_chat_format(tokenizer, fmt)
    ids = list(ids)
    if ids and ids[-1] == fmt.eot_id(hf):
        ids = ids[:-1]
    return hf.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def parse_assistant(fmt_or_tokenizer: Any, text: str) -> Message:
    """A sampled assistant turn (text, special tokens kept) -> ``{"role": "assistant",
    "content", ["reasoning_content"], ["tool_calls"]}``. ``fmt_or_tokenizer``: a
    :class:`ChatFormat`, its name, or a tokenizer (the format is detected). Malformed
    calls leave the text as content (rules in ``grpo_mega.data.chat.formats``)."""
    if isinstance(fmt_or_tokenizer, (ChatFormat, str)):
        fmt = resolve_chat_format(None, fmt_or_tokenizer)
    else:
        fmt = resolve_chat_format(fmt_or_tokenizer, None)
    return fmt.parse(text)


# ---------------------------------------------------------------------------
# The token-exact invariant
# ---------------------------------------------------------------------------

def _first_diff(got: Sequence[int], want: Sequence[int]) -> int | None:
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


def _ids_problem(what: str, got: Sequence[int], want: Sequence[int], hf: Any) -> list[str]:
    i = _first_diff(got, want)
    if i is None:
        return []
    show = lambda ids: f"{list(ids[i:i + 6])} {hf.decode(list(ids[i:i + 6]), skip_special_tokens=False)!r}"
    return [f"{what}: ids differ from the template's at token {i} (of {len(got)} vs {len(want)}): "
            f"got {show(got)}, expected {show(want)}"]


def check_trajectory(tokenizer: Any, segments: Sequence[Sequence[int]], messages: Sequence[Message],
                     tools: Sequence[Any] | None = None, *, token_ids: Sequence[int] | None = None,
                     loss_mask: Sequence[Any] | None = None, truncated: Sequence[bool] | None = None,
                     fmt: ChatFormat | str | None = None,
                     template_kwargs: Mapping[str, Any] | None = None) -> list[str]:
    """The token-exact invariant of one episode; returns the problems found (empty: exact).

    ``segments``: ``[first prompt, generated 1, appended 1, generated 2, ...]`` as recorded
    from the engine's outputs and the appended deltas (it may end with either kind).
    ``messages``: the episode's conversation: the first messages (no assistant message among
    them: a few-shot prompt would misalign the turns), then per turn the parsed
    assistant message and the environment's messages (those after the last assistant
    message count only if an appended segment follows it). ``token_ids``/``loss_mask``: the
    trainer's sequence and mask, when given, must be the segments' concatenation and 1
    exactly on generated segments. ``truncated``: per generated segment, whether the engine
    stopped at a length limit (it must then lack the end-of-turn token, else end with it).
    """
    hf, fmt = hf_tokenizer(tokenizer), resolve_chat_format(tokenizer, fmt)
    schemas, eot = _schemas(tools), fmt.eot_id(hf)
    segs = [[int(t) for t in s] for s in segments]
    assistants = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    gens = segs[1::2]
    if not segs or len(assistants) != len(gens):
        return [f"{len(gens)} generated segments but {len(assistants)} assistant messages: segments "
                "must alternate [prompt, generated, appended, generated, ...] with one assistant "
                "message per generated segment"]
    problems: list[str] = []
    flat = [t for s in segs for t in s]
    if token_ids is not None:
        problems += _ids_problem("token_ids (the trainer's sequence) vs the recorded segments",
                                 [int(t) for t in token_ids], flat, hf)
    if loss_mask is not None:
        want = [int(k % 2 == 1) for k, s in enumerate(segs) for _ in s]
        got = [int(bool(m)) for m in loss_mask]
        i = _first_diff(got, want)
        if i is not None:
            problems.append(f"loss_mask differs from the generated segments at position {i}: "
                            f"got {got[i:i + 8]}, expected {want[i:i + 8]}")
    first = assistants[0] if assistants else len(messages)
    # (a) the first prompt is the template's rendering of the first messages.
    problems += _ids_problem("segment 0 (first prompt)", segs[0],
                             render_ids(hf, messages[:first], schemas, True, template_kwargs=template_kwargs), hf)
    # (b) each appended segment is the template's delta after its turn.
    for k, gen in enumerate(gens):
        cut = not gen or gen[-1] != eot
        if eot in gen[:-1]:
            problems.append(f"segment {2 * k + 1} (generated {k + 1}): the end-of-turn token "
                            f"{fmt.eot_token!r} at position {gen.index(eot)} is not the last: the "
                            "boundary is shifted or the engine did not stop at it")
        if truncated is not None and k < len(truncated) and bool(truncated[k]) != cut:
            problems.append(f"segment {2 * k + 1} (generated {k + 1}): truncated={bool(truncated[k])} "
                            f"but it {'lacks' if cut else 'ends with'} the end-of-turn token")
        if 2 * k + 2 < len(segs):
            end = assistants[k + 1] if k + 1 < len(assistants) else len(messages)
            want = turn_delta_ids(hf, messages[:assistants[k] + 1], messages[assistants[k] + 1:end],
                                  schemas, truncated=cut, fmt=fmt, template_kwargs=template_kwargs)
            problems += _ids_problem(f"segment {2 * k + 2} (appended after turn {k + 1})", segs[2 * k + 2],
                                     want, hf)
    return problems + _check_text(hf, fmt, segs, messages, assistants, schemas, template_kwargs)


def _check_text(hf: Any, fmt: ChatFormat, segs: list[list[int]], messages: Sequence[Message],
                assistants: list[int], schemas: list[dict] | None,
                template_kwargs: Mapping[str, Any] | None) -> list[str]:
    """(c) The decoded trajectory equals the template's rendering of the real conversation,
    each assistant turn's body replaced by exactly what was sampled (see the package doc)."""
    ends_with_gen = len(segs) % 2 == 0
    covered = list(messages[:assistants[-1]] if ends_with_gen else messages)
    n = sum(m.get("role") == "assistant" for m in covered)
    shown = [({"role": "assistant", "content": _PLACEHOLDER.format(j)} if m.get("role") == "assistant"
              else m) for j, m in zip(_counter(covered), covered)]
    rendered = _render(hf, shown, schemas, True, template_kwargs)
    parts = _PLACEHOLDER_RE.split(rendered)
    extra = _prompt_beyond_header(hf, schemas, template_kwargs)
    if [int(p) for p in parts[1::2]] != list(range(n)) or extra is None:
        return [f"(c) not checked: the template does not render each assistant turn's content once, "
                f"in order, after a header its generation prompt starts with (placeholders seen: "
                f"{parts[1::2]})"]
    eot = fmt.eot_id(hf)
    for j in range(n):
        gen = segs[2 * j + 1]
        parts[2 * j + 1] = extra + hf.decode(gen[:-1] if gen and gen[-1] == eot else gen,
                                             skip_special_tokens=False, clean_up_tokenization_spaces=False)
    want = "".join(parts)
    ids = [t for s in (segs[:-1] if ends_with_gen else segs) for t in s]
    got = hf.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if got == want:
        return []
    i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return [f"(c) the decoded trajectory differs from the template's rendering of the conversation "
            f"at character {i}: got {got[max(0, i - 20):i + 40]!r}, expected {want[max(0, i - 20):i + 40]!r}"]


def _prompt_beyond_header(hf: Any, schemas: list[dict] | None,
                          template_kwargs: Mapping[str, Any] | None) -> str | None:
    """What the generation prompt holds beyond the header the template writes before a
    finished assistant turn's content ("" mostly; Qwen3 with enable_thinking=False: an empty
    think block the model saw as prompt). None if the prompt does not start with the header."""
    history = _render(hf, [_DUMMY_USER], schemas, False, template_kwargs)
    prompt = _render(hf, [_DUMMY_USER], schemas, True, template_kwargs)
    mark = _PLACEHOLDER.format(0)
    # A user turn after the assistant's, so that no template treats it as the last turn.
    turn = _render(hf, [_DUMMY_USER, {"role": "assistant", "content": mark}, _DUMMY_USER], schemas, False,
                   template_kwargs)
    at = turn.find(mark, len(history))
    header = turn[len(history):at]
    if not (prompt.startswith(history) and turn.startswith(history) and at >= 0
            and prompt[len(history):].startswith(header)):
        return None
    return prompt[len(history) + len(header):]


def _counter(messages: Sequence[Message]) -> list[int]:
    """Per message, the number of assistant messages before it (a placeholder's index)."""
    out, n = [], 0
    for m in messages:
        out.append(n)
        n += m.get("role") == "assistant"
    return out
