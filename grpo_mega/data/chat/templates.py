"""Reference chat templates, one per family, and tiny local tokenizers that ship them.

What: :data:`TEMPLATES` holds a Jinja chat template per chat format (the string a real
tokenizer directory ships as ``chat_template``), written in the style of the family's
real template, with its tool-call and tool-result conventions; :func:`write_chat_tokenizer`
trains a tiny byte-level BPE tokenizer (``grpo_mega.data.tokenizer.train_bpe_tokenizer``),
adds the family's special tokens as single tokens and saves it with the template, so
transformers' ``apply_chat_template`` renders it offline.

Why: the hub is unreachable here, so the token-exact tests (and the multi-turn rollout
and gateway tests) need local tokenizers whose templates behave like the real ones in the
ways that break token-in/token-out: ChatML's "\\n" after ``<|im_end|>``, Qwen's merging of
consecutive tool results into ONE user turn, Qwen3 dropping earlier turns' reasoning when
it re-renders history, Llama 3's tools in the first user message and ``ipython`` role,
Mistral's ``[TOOL_CALLS]``/``[TOOL_RESULTS]`` and no generation prompt, Gemma's missing
system role and strict user/model alternation.

Conventions of the families whose real templates have none (kept simple, documented in
docs/guides/multi-turn.md): Llama 3 renders parallel calls as JSON objects joined by
``"; "`` (vLLM's llama3_json parser reads that); Gemma writes a call as a fenced
``tool_code`` block holding ``{"name", "arguments"}`` JSON and a result as a fenced
``tool_output`` block, consecutive results in one user turn.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Sequence

__all__ = ["TEMPLATES", "FAMILY_TOKENS", "write_chat_tokenizer", "chat_corpus"]

_QWEN_TOOLS_BLOCK = (
    "{{- \"# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": "
    "<function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n")

# Tool results: consecutive ``tool`` messages share ONE user turn (the slime bug was one
# user turn each). Shared by ChatML and Qwen3, as in the real templates.
_QWEN_TOOL_MESSAGE = """\
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
"""

CHATML = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- '\\n\\n' }}
    """ + _QWEN_TOOLS_BLOCK + """\
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
""" + _QWEN_TOOL_MESSAGE + "{%- endif %}\n"

# Qwen3: reasoning in <think> tags; an assistant turn before the last real user query is
# re-rendered WITHOUT its reasoning (what token-in/token-out must not do).
QWEN3 = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    """ + _QWEN_TOOLS_BLOCK + """\
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not (message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
""" + _QWEN_TOOL_MESSAGE + """\
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

# Llama 3.1 style: headers, <|eot_id|>, tools in the first user message, ipython results.
LLAMA3 = """\
{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools %}
    {%- if messages | length == 0 or messages[0]['role'] != 'user' %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {%- set first_user_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' }}
    {{- "Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. Do not use variables.\\n\\n' }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>" }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'assistant' and message.tool_calls %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
        {%- for tool_call in message.tool_calls %}
            {%- set tool_call = tool_call.function %}
            {%- if not loop.first %}
                {{- '; ' }}
            {%- endif %}
            {{- '{"name": "' + tool_call.name + '", "parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}' }}
        {%- endfor %}
        {{- '<|eot_id|>' }}
    {%- elif message.role == 'tool' or message.role == 'ipython' %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}
        {{- message.content }}
        {{- '<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Mistral (Small 3 / v7 style): [SYSTEM_PROMPT], [AVAILABLE_TOOLS] up front, [INST] turns,
# calls as a JSON list after [TOOL_CALLS], one [TOOL_RESULTS] block per result, and no
# generation prompt (the model answers right after [/INST] or [/TOOL_RESULTS]).
MISTRAL = """\
{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {{- '[SYSTEM_PROMPT]' + messages[0]['content'] + '[/SYSTEM_PROMPT]' }}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if tools %}
    {{- '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}
{%- endif %}
{%- for message in loop_messages %}
    {%- if message['role'] == 'user' %}
        {{- '[INST]' + message['content'] + '[/INST]' }}
    {%- elif message['role'] == 'system' %}
        {{- '[SYSTEM_PROMPT]' + message['content'] + '[/SYSTEM_PROMPT]' }}
    {%- elif message['role'] == 'assistant' %}
        {%- if message['content'] %}
            {{- message['content'] }}
        {%- endif %}
        {%- if message['tool_calls'] %}
            {{- '[TOOL_CALLS][' }}
            {%- for tool_call in message['tool_calls'] %}
                {%- if not loop.first %}
                    {{- ', ' }}
                {%- endif %}
                {%- if tool_call['id'] is defined %}
                    {{- {'name': tool_call['function']['name'], 'arguments': tool_call['function']['arguments'], 'id': tool_call['id']} | tojson }}
                {%- else %}
                    {{- {'name': tool_call['function']['name'], 'arguments': tool_call['function']['arguments']} | tojson }}
                {%- endif %}
            {%- endfor %}
            {{- ']' }}
        {%- endif %}
        {{- eos_token }}
    {%- elif message['role'] == 'tool' %}
        {%- if message['tool_call_id'] is defined %}
            {{- '[TOOL_RESULTS]' + ({'content': message['content'], 'call_id': message['tool_call_id']} | tojson) + '[/TOOL_RESULTS]' }}
        {%- else %}
            {{- '[TOOL_RESULTS]' + ({'content': message['content']} | tojson) + '[/TOOL_RESULTS]' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Only user, system, assistant and tool roles are supported, not ' + message['role']) }}
    {%- endif %}
{%- endfor %}
"""

# Gemma: no system role (its text opens the first user turn), user/model alternation
# enforced, "\n" after <end_of_turn>; tools as fenced JSON blocks (see the module docstring).
GEMMA = """\
{{- bos_token }}
{%- set ns = namespace(turn=0, prefix='') %}
{%- if messages[0]['role'] == 'system' %}
    {%- set ns.prefix = messages[0]['content'] + '\\n\\n' %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if tools %}
    {%- set ns.prefix = ns.prefix + 'You can call these tools. To call one, answer with a ```tool_code``` block holding {"name": <tool name>, "arguments": <JSON object>}; results come back in ```tool_output``` blocks.\\n' %}
    {%- for tool in tools %}
        {%- set ns.prefix = ns.prefix + (tool | tojson) + '\\n' %}
    {%- endfor %}
    {%- set ns.prefix = ns.prefix + '\\n' %}
{%- endif %}
{%- for message in loop_messages %}
    {%- if message['role'] == 'system' %}
        {{- raise_exception('System role is only supported as the first message') }}
    {%- endif %}
    {%- set role = 'model' if message['role'] == 'assistant' else 'user' %}
    {%- if message['role'] == 'tool' and not loop.first and loop_messages[loop.index0 - 1]['role'] == 'tool' %}
        {{- '\\n' }}
    {%- else %}
        {%- if (role == 'user') != (ns.turn % 2 == 0) %}
            {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
        {%- endif %}
        {{- '<start_of_turn>' + role + '\\n' }}
        {%- if ns.turn == 0 %}
            {{- ns.prefix }}
        {%- endif %}
        {%- set ns.turn = ns.turn + 1 %}
    {%- endif %}
    {%- if message['role'] == 'tool' %}
        {{- '```tool_output\\n' + message['content'] + '\\n```' }}
    {%- elif message['role'] == 'assistant' %}
        {%- set content = (message['content'] or '') | trim %}
        {{- content }}
        {%- for tool_call in message['tool_calls'] or [] %}
            {%- if content or not loop.first %}
                {{- '\\n' }}
            {%- endif %}
            {{- '```tool_code\\n' + ({'name': tool_call['function']['name'], 'arguments': tool_call['function']['arguments']} | tojson) + '\\n```' }}
        {%- endfor %}
    {%- else %}
        {{- message['content'] | trim }}
    {%- endif %}
    {%- if loop.last or not (message['role'] == 'tool' and loop_messages[loop.index0 + 1]['role'] == 'tool') %}
        {{- '<end_of_turn>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<start_of_turn>model\\n' }}
{%- endif %}
"""

TEMPLATES: dict[str, str] = {"chatml": CHATML, "qwen3": QWEN3, "llama3": LLAMA3, "mistral": MISTRAL,
                             "gemma": GEMMA}
"""Chat format name -> its reference Jinja chat template."""

FAMILY_TOKENS: dict[str, dict] = {
    "chatml": {"special": ["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
               "added": ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
               "eos": "<|im_end|>"},
    "qwen3": {"special": ["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
              "added": ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
                        "</tool_response>"],
              "eos": "<|im_end|>"},
    "llama3": {"special": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                           "<|eot_id|>", "<|eom_id|>"],
               "added": [], "bos": "<|begin_of_text|>", "eos": "<|eot_id|>"},
    "mistral": {"special": ["[INST]", "[/INST]", "[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]",
                            "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[SYSTEM_PROMPT]",
                            "[/SYSTEM_PROMPT]"],
                "added": [], "bos": "<s>", "eos": "</s>"},
    "gemma": {"special": ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"],
              "added": [], "bos": "<bos>", "eos": "<eos>"},
}
"""Per family: tokens added as single special tokens (dropped by ``skip_special_tokens``),
tokens added as single ordinary tokens (kept by it, as Qwen's ``<think>``), bos and eos."""


def chat_corpus() -> list[str]:
    """A small corpus with the words the tests and templates use (so BPE merges exist)."""
    words = ("the answer is what add numbers tool call result user assistant model system "
             "hello world please compute think step first then name arguments parameters "
             "function content query weather city Paris Rome calculator expression")
    texts = [words, "You are a helpful assistant.", '{"name": "add", "arguments": {"a": 1, "b": 2}}']
    texts += [f"What is {a} + {b}? The answer is {a + b}." for a in range(0, 60, 3) for b in range(0, 60, 7)]
    return texts


def write_chat_tokenizer(family: str, out_dir: str | os.PathLike, base_dir: str | os.PathLike | None = None,
                         texts: Sequence[str] | None = None, vocab_size: int = 400,
                         chat_template: str | None = None) -> Path:
    """An HF tokenizer directory for ``family``: byte-level BPE, the family's special tokens
    added as single tokens, bos/eos set, ``chat_template`` (default ``TEMPLATES[family]``).

    ``base_dir``: an already trained ``train_bpe_tokenizer`` directory to start from (copied;
    training once and copying is what keeps a test session fast); else one is trained on
    ``texts`` (default :func:`chat_corpus`). Returns ``out_dir``.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    from grpo_mega.data.tokenizer import train_bpe_tokenizer

    if family not in FAMILY_TOKENS:
        raise ValueError(f"family={family!r}; choose one of {sorted(FAMILY_TOKENS)}")
    spec = FAMILY_TOKENS[family]
    out = Path(out_dir)
    if base_dir is None:
        train_bpe_tokenizer(list(texts or chat_corpus()), out, vocab_size)
    elif Path(base_dir) != out:
        shutil.copytree(base_dir, out, dirs_exist_ok=True)
    # A stale special_tokens_map.json would override the bos/eos set below on load
    # (transformers 5 writes only tokenizer_config.json).
    (out / "special_tokens_map.json").unlink(missing_ok=True)
    tok = AutoTokenizer.from_pretrained(str(out))
    special = {f"{key}_token": spec[key] for key in ("bos", "eos") if key in spec}
    tok.add_special_tokens({**special, "additional_special_tokens": list(spec["special"])})
    if spec["added"]:
        tok.add_tokens(list(spec["added"]))
    tok.chat_template = TEMPLATES[family] if chat_template is None else chat_template
    tok.save_pretrained(str(out))
    return out
