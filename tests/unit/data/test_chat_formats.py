"""Chat formats: detection from a tokenizer's template, the end-of-turn token, and parsing
sampled assistant turns (content, Qwen3 reasoning, single and parallel tool calls) back
into messages, for the five template families.
"""
from __future__ import annotations

import copy

import pytest

from grpo_mega.data.chat import (CHAT_FORMATS, ChatFormatError, detect_chat_format, get_chat_format,
                                 parse_assistant)
from tests.unit.data.conftest import FAMILIES

WRITES_CALL_IDS = {"mistral"}  # the other families' templates do not render call ids


def call(i, name, args, call_id=None):
    return {"id": call_id or f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}}


def sampled_text(tok, messages, assistant, tools=None, template_kwargs=None):
    """What a model trained on the template generates for ``assistant``: the template's
    rendering of it as the last message, after the generation prompt, without the
    end-of-turn token."""
    hf, fmt, kw = tok.hf, detect_chat_format(tok), template_kwargs or {}
    prompt = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True, **kw)
    full = hf.apply_chat_template(messages + [assistant], tools=tools, tokenize=False, **kw)
    assert full.startswith(prompt)
    body = full[len(prompt):]
    return body[:body.rindex(fmt.eot_token)]


def turns_for(family):
    """Assistant messages a family can render and read back exactly."""
    ids = ("a1b2c3d4e", "f5g6h7i8j") if family in WRITES_CALL_IDS else (None, None)
    out = [
        {"role": "assistant", "content": "The answer is 7."},
        {"role": "assistant", "content": "", "tool_calls": [call(0, "add", {"a": 3, "b": 4}, ids[0])]},
        {"role": "assistant", "content": "", "tool_calls": [call(0, "add", {"a": 1, "b": 2}, ids[0]),
                                                            call(1, "weather", {"city": "Paris"}, ids[1])]},
    ]
    if family != "llama3":  # Llama 3's template drops the content of a tool-call turn
        out.append({"role": "assistant", "content": "Let me add.",
                    "tool_calls": [call(0, "add", {"a": 3, "b": 4}, ids[0])]})
    if family == "qwen3":
        out = [dict(m, reasoning_content="First add, then check.") for m in out]
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_format_is_detected_from_each_template(chat_tokenizers, family):
    """Guards against detection picking the wrong family (Qwen3's template is ChatML plus
    <think>: trying ChatML first would lose its reasoning parser), and against an
    end-of-turn token that is not one token (the engine could never stop on it)."""
    tok = chat_tokenizers[family]
    fmt = detect_chat_format(tok)
    assert fmt.name == family
    assert tok.hf.convert_ids_to_tokens(fmt.eot_id(tok)) == fmt.eot_token


def test_chat_format_errors_name_the_config_field(chat_tokenizers):
    """An unknown template, a missing template or a format whose end-of-turn token the
    tokenizer splits must fail with the field that sets the format explicitly."""
    hf = copy.deepcopy(chat_tokenizers["chatml"].hf)
    hf.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    with pytest.raises(ChatFormatError, match="env.chat_format"):
        detect_chat_format(hf)
    hf.chat_template = None
    with pytest.raises(ChatFormatError, match="env.chat_format"):
        detect_chat_format(hf)
    with pytest.raises(ChatFormatError, match="env.chat_format"):
        get_chat_format("chatml2")
    with pytest.raises(ChatFormatError, match="not one"):
        get_chat_format("llama3").eot_id(chat_tokenizers["chatml"])
    assert list(CHAT_FORMATS)[:2] == ["qwen3", "chatml"]


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_parse_assistant_round_trips_the_template(chat_tokenizers, family):
    """parse_assistant must read back exactly what the template renders: content, Qwen3's
    reasoning, single and parallel tool calls with arguments parsed as JSON objects (not
    left as strings), Mistral's own call ids (a wrong id misroutes the tool results); a
    trailing end-of-turn token is ignored."""
    tok = chat_tokenizers[family]
    fmt = detect_chat_format(tok)
    first = [{"role": "user", "content": "What is 3 + 4?"}]
    for msg in turns_for(family):
        text = sampled_text(tok, first, msg)
        assert parse_assistant(tok, text) == _without_empty(msg), text
        assert parse_assistant(family, text + fmt.eot_token) == _without_empty(msg)


def _without_empty(msg):
    return {k: v for k, v in msg.items() if not (k == "tool_calls" and not v)}


MALFORMED = {
    "chatml": ['<tool_call>\n{"name": "add", "arguments": {"a": 3,}}\n</tool_call>',
               'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 3}}',
               '<tool_call>\n{"arguments": {"a": 3}}\n</tool_call>',
               '<tool_call>\n{"name": "add", "arguments": {"a": 3}}\n</tool_call>\n<tool_call>\n{"name": "add"'],
    "qwen3": ['<tool_call>\n{"name": "add", "arguments": "a=3"}\n</tool_call>',
              '<tool_call>\n{"name": "add", "arguments": {"a": 3}}\n</tool_call> and more text'],
    "llama3": ['{"name": "add", "parameters": {"a": 3}} then text', '{"name": "add", "parameters": [1, 2]}',
               '{not json at all}'],
    "mistral": ['[TOOL_CALLS][{"name": "add", "arguments": {"a": 3}', '[TOOL_CALLS]{"name": "add"}',
                '[TOOL_CALLS][]'],
    "gemma": ['```tool_code\n{"name": "add", "arguments": {"a": 3}\n```', '```tool_code\nadd(a=3)\n```',
              '```tool_code\n{"name": "add", "arguments": {"a": 3}}'],
}


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_malformed_tool_calls_become_content(family):
    """A malformed call (bad JSON, no name, non-object arguments, an unclosed tag, text
    after the calls) must neither raise (a dead rollout) nor half-parse (the environment
    would run a call the model did not write): the whole text is the content."""
    for text in MALFORMED[family]:
        msg = parse_assistant(family, text)
        assert msg == {"role": "assistant", "content": text}, text


def test_chat_qwen3_reasoning_cut_by_length_is_reasoning():
    """A Qwen3 turn cut by the length limit inside <think> has no content yet; its text must
    not be taken for the answer (a reward function would grade the reasoning)."""
    msg = parse_assistant("qwen3", "<think>\nFirst add 3 and")
    assert msg == {"role": "assistant", "content": "", "reasoning_content": "First add 3 and"}
    assert "reasoning_content" not in parse_assistant("qwen3", "7")
