"""Multi-turn token-in/token-out: episodes built turn by turn with ``turn_delta_ids`` are
exactly the template's rendering of the conversation, and ``check_trajectory`` flags each
way a driver breaks that (dropped or doubled boundary tokens, tool results split into
separate user turns, a re-tokenized or re-rendered history, shifted boundaries, a wrong
loss mask, a truncated turn left open), for the five template families with single and
parallel tool calls.
"""
from __future__ import annotations

import copy
import re

import pytest

from grpo_mega.data.chat import (ChatFormatError, check_trajectory, detect_chat_format, parse_assistant,
                                 render_ids, turn_delta_ids)
from grpo_mega.data.chat.templates import MISTRAL
from tests.unit.data.conftest import FAMILIES
from tests.unit.data.test_chat_formats import WRITES_CALL_IDS, call, sampled_text

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]
FIRST = [{"role": "system", "content": "You are a calculator."},
         {"role": "user", "content": "What is 1 + 2 and 3 + 4?"}]
# What the template writes after the last turn's end-of-turn token (the model never samples it).
TRAILING = {"chatml": "\n", "qwen3": "\n", "llama3": "", "mistral": "", "gemma": "\n"}


def script(family):
    """(assistant message, environment answer) per turn: parallel calls, a single call with
    content, an answer, a new user query, a final answer (no answer from the environment)."""
    ids = ("a1b2c3d4e", "f5g6h7i8j", "k9l0m1n2o") if family in WRITES_CALL_IDS else ("call_0", "call_1", "call_0")
    turns = [
        ({"role": "assistant", "content": "", "tool_calls": [call(0, "add", {"a": 1, "b": 2}, ids[0]),
                                                             call(1, "add", {"a": 3, "b": 4}, ids[1])]},
         [{"role": "tool", "content": "3", "tool_call_id": ids[0]},
          {"role": "tool", "content": "7", "tool_call_id": ids[1]}]),
        ({"role": "assistant", "content": "" if family == "llama3" else "Let me check.",
          "tool_calls": [call(0, "add", {"a": 3, "b": 4}, ids[2])]},
         [{"role": "tool", "content": "7", "tool_call_id": ids[2]}]),
        ({"role": "assistant", "content": "3 and 7."}, [{"role": "user", "content": "Thanks. And 2 + 2?"}]),
        ({"role": "assistant", "content": "4."}, None),
    ]
    if family == "qwen3":
        turns = [(dict(a, reasoning_content=f"Step {k}: think first."), env) for k, (a, env) in enumerate(turns)]
    return turns


def build_episode(tok, family, generate=None, template_kwargs=None, turns=None):
    """What the rollout driver does: the first prompt, then per turn the sampled ids (by
    default the canonical encoding of what the template renders for the scripted turn, plus
    the end-of-turn token) and ``turn_delta_ids`` for the environment's answer."""
    fmt, hf = detect_chat_format(tok), tok.hf
    messages = [dict(m) for m in FIRST]
    segments = [render_ids(tok, messages, TOOLS, template_kwargs=template_kwargs)]
    for k, (assistant, env) in enumerate(turns or script(family)):
        text = sampled_text(tok, messages, assistant, TOOLS, template_kwargs)
        gen = (generate or (lambda k, t: hf.encode(t, add_special_tokens=False)))(k, text) + [fmt.eot_id(tok)]
        messages.append(parse_assistant(tok, text))
        segments.append(gen)
        if env:
            segments.append(turn_delta_ids(tok, messages, env, TOOLS, template_kwargs=template_kwargs))
            messages += env
    return segments, messages


def decode(tok, ids):
    return tok.hf.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def flat(segments):
    return [t for s in segments for t in s]


@pytest.fixture(scope="module")
def episodes(chat_tokenizers):
    return {f: build_episode(chat_tokenizers[f], f) for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_multi_turn_episode_decodes_to_the_template_rendering(chat_tokenizers, episodes, family):
    """An episode appended turn by turn must decode to exactly the template's rendering of
    the whole conversation: a separator dropped after the end-of-turn token (verl's bug,
    e.g. the delta cut after a dummy user turn instead of an assistant turn), one doubled, or
    tool results split into separate turns would all show here. Qwen3's template re-renders
    turns before the last user query without their reasoning; token-in/token-out keeps the
    sampled <think> blocks, so exactly those blocks are the difference."""
    tok = chat_tokenizers[family]
    segments, messages = episodes[family]
    assert [m["role"] for m in messages if m["role"] == "assistant"] == ["assistant"] * 4
    text = decode(tok, flat(segments))
    want = tok.hf.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    if family == "qwen3":
        assert text.count("<think>") == 4  # every sampled reasoning block is kept
        last_query = text.rindex("<|im_start|>user\nThanks.")
        text = re.sub(r"<think>\n.*?\n</think>\n\n", "", text[:last_query], flags=re.S) + text[last_query:]
    assert text + TRAILING[family] == want


@pytest.mark.parametrize("family", FAMILIES)
def test_multi_turn_check_trajectory_accepts_an_exact_episode(chat_tokenizers, episodes, family):
    """check_trajectory runs every step in production: a false alarm on an exact episode
    (e.g. Qwen3's dropped history reasoning taken for drift, or a placeholder rendered with
    the end-of-turn token twice) would drown the real violations in the metric."""
    segments, messages = episodes[family]
    mask = [int(k % 2 == 1) for k, s in enumerate(segments) for _ in s]
    assert check_trajectory(chat_tokenizers[family], segments, messages, TOOLS, token_ids=flat(segments),
                            loss_mask=mask, truncated=[False] * 4) == []


def test_multi_turn_qwen3_without_thinking_is_exact(chat_tokenizers):
    """Qwen3 with enable_thinking=False: the generation prompt ends with an empty think
    block that the template does not write when it re-renders a finished turn. The delta's
    history check and check (c) must treat it as prompt the model saw (not as a re-rendered
    history, a false alarm), and a check run without the rollout's template_kwargs must not
    pass silently."""
    tok, kw = chat_tokenizers["qwen3"], {"enable_thinking": False}
    turns = [(dict(a, reasoning_content=""), env) for a, env in script("qwen3")]
    segments, messages = build_episode(tok, "qwen3", template_kwargs=kw, turns=turns)
    assert decode(tok, flat(segments)).count("<think>\n\n</think>\n\n") == 4  # one per generation prompt
    assert check_trajectory(tok, segments, messages, TOOLS, template_kwargs=kw, token_ids=flat(segments)) == []
    assert "(c)" in problems_of(tok, segments, messages)


def corrupt(episodes, family, k, change):
    segments, messages = copy.deepcopy(episodes[family])
    segments[k] = change(segments[k])
    return segments, messages


def problems_of(tok, segments, messages, **kw):
    problems = check_trajectory(tok, segments, messages, TOOLS, **kw)
    assert problems, "not flagged"
    return "\n".join(problems)


@pytest.mark.parametrize("family", FAMILIES)
def test_multi_turn_dropped_separator_is_flagged(chat_tokenizers, episodes, family):
    """The first token after an end-of-turn token dropped (ChatML's and Gemma's "\\n", Llama
    3's next header, Mistral's [TOOL_RESULTS]): the verl bug, compounding every turn. Both the
    id check (b) and the text check (c) must see it."""
    tok = chat_tokenizers[family]
    report = problems_of(tok, *corrupt(episodes, family, 2, lambda s: s[1:]))
    assert "segment 2 (appended after turn 1)" in report and "(c)" in report


@pytest.mark.parametrize("family", FAMILIES)
def test_multi_turn_doubled_separator_is_flagged(chat_tokenizers, episodes, family):
    """The separator after an end-of-turn token written twice (once by a driver that adds
    it by hand, once by the delta)."""
    tok = chat_tokenizers[family]
    report = problems_of(tok, *corrupt(episodes, family, 4, lambda s: s[:1] + s))
    assert "segment 4 (appended after turn 2)" in report and "(c)" in report


SEPARATE_TOOL_TURNS = {
    "chatml": "\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>user\n"
              "<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    "gemma": "\n<start_of_turn>user\n```tool_output\n3\n```<end_of_turn>\n<start_of_turn>user\n"
             "```tool_output\n7\n```<end_of_turn>\n<start_of_turn>model\n",
}
SEPARATE_TOOL_TURNS["qwen3"] = SEPARATE_TOOL_TURNS["chatml"]


@pytest.mark.parametrize("family", sorted(SEPARATE_TOOL_TURNS))
def test_multi_turn_tool_results_split_into_user_turns_are_flagged(chat_tokenizers, episodes, family):
    """Two consecutive tool results rendered as two user turns (the slime bug) where the
    template merges them into ONE user turn."""
    tok = chat_tokenizers[family]
    split = tok.hf.encode(SEPARATE_TOOL_TURNS[family], add_special_tokens=False)
    report = problems_of(tok, *corrupt(episodes, family, 2, lambda s: split))
    assert "segment 2 (appended after turn 1)" in report and "(c)" in report


def non_canonical(tok):
    """Sample turn 2 one character per token, as a model may: the same text, other ids."""
    def generate(k, text):
        canonical = tok.hf.encode(text, add_special_tokens=False)
        if k != 1:
            return canonical
        ids = [i for piece in re.split(r"(<[^>]+>|\[[A-Z_/]+\])", text) if piece
               for i in (tok.hf.encode(piece, add_special_tokens=False) if piece[0] in "<[" else
                         [t for ch in piece for t in tok.hf.encode(ch, add_special_tokens=False)])]
        assert ids != canonical and decode(tok, ids) == text
        return ids
    return generate


@pytest.mark.parametrize("family", FAMILIES)
def test_multi_turn_retokenized_history_is_flagged(chat_tokenizers, family):
    """The trainer's sequence rebuilt from text (the history re-rendered and re-encoded)
    after the model sampled non-canonical ids (encode(decode(ids)) != ids): the model would
    be trained on ids it never produced, with log-probs of others. The segments are exact,
    so only the comparison of token_ids with them can see it."""
    tok = chat_tokenizers[family]
    segments, messages = build_episode(tok, family, generate=non_canonical(tok))
    gen = segments[3]
    assert tok.hf.encode(decode(tok, gen[:-1]), add_special_tokens=False) != gen[:-1]
    assert check_trajectory(tok, segments, messages, TOOLS, token_ids=flat(segments)) == []
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    rerendered = render_ids(tok, messages[:last], TOOLS) + segments[-1]
    assert "token_ids" in problems_of(tok, segments, messages, token_ids=rerendered)
    retokenized = tok.hf.encode(decode(tok, flat(segments)), add_special_tokens=False)
    assert "token_ids" in problems_of(tok, segments, messages, token_ids=retokenized)


@pytest.mark.parametrize("family", FAMILIES)
def test_multi_turn_shifted_boundary_is_flagged(chat_tokenizers, episodes, family):
    """A boundary one token off: the token after the end-of-turn token counted as generated
    (a tool token trained on), the end-of-turn token counted as appended (a model token out
    of the loss, its log-prob shifted onto the wrong token), or the loss mask shifted by one."""
    tok = chat_tokenizers[family]
    segments, messages = episodes[family]
    moved = copy.deepcopy(segments)
    moved[1], moved[2] = moved[1] + moved[2][:1], moved[2][1:]
    assert "is not the last" in problems_of(tok, moved, messages)
    moved = copy.deepcopy(segments)
    moved[3], moved[4] = moved[3][:-1], moved[3][-1:] + moved[4]
    assert "truncated=False" in problems_of(tok, moved, messages, truncated=[False] * 4)
    mask = [int(k % 2 == 1) for k, s in enumerate(segments) for _ in s]
    assert "loss_mask" in problems_of(tok, segments, messages, loss_mask=[0] + mask[:-1])


@pytest.mark.parametrize("family", FAMILIES)
def test_multi_turn_truncated_turn_gets_the_end_of_turn_token(chat_tokenizers, episodes, family):
    """A turn cut by the length limit has no end-of-turn token; the delta must append it
    (not trainable), or the next turn's header runs into the cut text."""
    tok = chat_tokenizers[family]
    fmt = detect_chat_format(tok)
    segments, messages = copy.deepcopy(episodes[family])
    a3 = [i for i, m in enumerate(messages) if m["role"] == "assistant"][2]
    segments[5] = segments[5][:-3]  # turn 3 cut before its end-of-turn token
    messages[a3] = parse_assistant(tok, decode(tok, segments[5]))
    segments[6] = turn_delta_ids(tok, messages[:a3 + 1], messages[a3 + 1:a3 + 2], TOOLS, truncated=True)
    assert segments[6][0] == fmt.eot_id(tok)
    assert check_trajectory(tok, segments, messages, TOOLS, truncated=[False, False, True, False]) == []
    segments[6] = segments[6][1:]  # the driver forgot the end-of-turn token
    report = problems_of(tok, segments, messages)
    assert "segment 6 (appended after turn 3)" in report and "(c)" in report


def test_multi_turn_template_that_rerenders_history_is_refused(chat_tokenizers):
    """A template that moves earlier text once a new message follows (Mistral v3 put the
    tool list before the LAST user message) cannot be continued id by id; turn_delta_ids
    must say so instead of returning a delta that silently disagrees with the template."""
    hf = copy.deepcopy(chat_tokenizers["mistral"].hf)
    hf.chat_template = MISTRAL.replace(
        "{{- '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}",
        "{%- set ns = namespace(last_user=-1) %}{%- for m in loop_messages %}{%- if m['role'] == 'user' %}"
        "{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}").replace(
        "{{- '[INST]' + message['content'] + '[/INST]' }}",
        "{%- if tools and loop.index0 == ns.last_user %}"
        "{{- '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{%- endif %}"
        "{{- '[INST]' + message['content'] + '[/INST]' }}")
    assert hf.chat_template != MISTRAL
    history = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
    assert turn_delta_ids(hf, history, [{"role": "tool", "content": "3"}], TOOLS)  # no user: fine
    with pytest.raises(ChatFormatError, match="differently"):
        turn_delta_ids(hf, history, [{"role": "user", "content": "And now?"}], TOOLS)


def test_multi_turn_segments_and_messages_must_align(chat_tokenizers, episodes):
    """A generated segment without its assistant message (or the reverse) makes every later
    boundary meaningless: report it instead of comparing misaligned turns."""
    segments, messages = episodes["chatml"]
    report = problems_of(chat_tokenizers["chatml"], segments[:-2], messages)
    assert "3 generated segments but 4 assistant messages" in report
