"""The tool-use demo's task, chat format and warm-started model (``make demo ARGS=--tools``).

Task: two-digit multiplication, ``"37*45="`` -> ``1665``. The tiny model (the dense demo's
shape) cannot multiply; with the ``calculator`` tool it only has to call it with the two
operands and copy the result back. An episode, as the chat template renders it::

    37*45=          the user's question
    [37*45]</s>     turn 1: the model calls calculator(expression="37*45")
    1665=           the tool's result, rendered by the template (never trained on)
    1665</s>        turn 2: the model's answer

The reward is 1 when the last turn is exactly the product (``exact_answer``). A short
supervised warm start on whole episodes (both model turns) stops once held-out greedy
accuracy, played against the real tool, enters ``TARGET_ACC``, so GRPO starts weak but
with signal.

The template is a character-level format of its own (the tokenizer knows only digits,
``*``, ``=``, ``[`` and ``]``); it is registered as the chat format ``demo_tools``.

    python -m grpo_mega.demo.tools [CACHE_DIR]   # rebuild the assets (about 45 s on 2 cores)
"""
from __future__ import annotations

import os
import random
import re
import sys
from pathlib import Path

import torch

from grpo_mega.demo.assets import (EVAL_SIZE, _write_jsonl, cached_build, say,
                                   supervised_warm_start)

VERSION = "tools_v1"

CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- if m.tool_calls -%}[{{ m.tool_calls[0].function.arguments.expression }}]"
    "{%- else -%}{{ m.content }}{%- endif -%}{{ eos_token }}"
    "{%- elif m.role == 'tool' -%}{{ m.content }}="
    "{%- else -%}{{ m.content }}{%- endif -%}"
    "{%- endfor -%}")
"""User text as is; a tool call as ``[expression]``; a tool result followed by ``=``; every
assistant turn ends with eos. There is no generation prompt."""

CALL = re.compile(r"^\[((?:0|[1-9][0-9]{0,7})\*(?:0|[1-9][0-9]{0,7}))\]$")
"""A well-formed call only (no leading zeros: the calculator refuses ``07``): the demo's
tokenizer cannot spell the calculator's error messages, so anything else is an answer."""


def parse_turn(text: str) -> dict:
    """A sampled turn (end-of-turn token stripped) -> an assistant message: ``[expr]`` is a
    ``calculator`` call, anything else the answer."""
    m = CALL.match(text)
    if m is None:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function",
         "function": {"name": "calculator", "arguments": {"expression": m.group(1)}}}]}


def _demo_format():
    from grpo_mega.data.chat import ChatFormat

    return ChatFormat(name="demo_tools", eot_token="</s>", markers=("m.tool_calls[0].function.arguments.expression",),
                      parse=parse_turn)


DEMO_FORMAT = _demo_format()
"""The demo's chat format (``env.chat_format: grpo_mega.demo.tools:DEMO_FORMAT``)."""


def problems(seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, held-out) rows ``{"prompt": "a*b=", "answer": str(a*b)}`` for a, b in 10..99."""
    rows = [{"prompt": f"{a}*{b}=", "answer": str(a * b)} for a in range(10, 100) for b in range(10, 100)]
    random.Random(seed).shuffle(rows)
    return rows[EVAL_SIZE:], rows[:EVAL_SIZE]


def episode_text(prompt: str, answer: str) -> list[tuple[str, bool]]:
    """The ideal episode as (text, is the model's) pieces; eos follows each model piece."""
    expr = prompt.rstrip("=")
    return [(prompt, False), (f"[{expr}]", True), (f"{answer}=", False), (answer, True)]


def _build_tokenizer(out: Path) -> Path:
    from grpo_mega.data.tokenizer import train_sentencepiece, write_hf_tokenizer_dir

    texts = [f"{a}*{b}=[{a}*{b}]{a * b}={a * b}" for a in range(10, 100) for b in range(10, 100)]
    model = train_sentencepiece(texts, out / "spm" / "tools", vocab_size=20, model_type="char",
                                byte_fallback=False)
    return write_hf_tokenizer_dir(model, out / "tokenizer", chat_template=CHAT_TEMPLATE)


def _calculator(expr: str) -> str:
    a, _, b = expr.partition("*")
    return str(int(a) * int(b)) if a.isdigit() and b.isdigit() else "error"


@torch.no_grad()
def _greedy(model, ids: list[list[int]], eos: int, max_new: int) -> list[list[int]]:
    """Greedy continuations (eos included when reached) of same-length prompts."""
    x = torch.tensor(ids)
    outs: list[list[int]] = [[] for _ in ids]
    done = [False] * len(ids)
    for _ in range(max_new):
        nxt = model(x).logits[:, -1].argmax(-1)
        for i, t in enumerate(nxt.tolist()):
            if not done[i]:
                outs[i].append(t)
                done[i] = t == eos
        x = torch.cat([x, nxt[:, None]], 1)
        if all(done):
            break
    return outs


def greedy_accuracy(model, tok, rows: list[dict]) -> float:
    """Held-out accuracy of whole greedy episodes against the real tool (HF model)."""
    correct = 0
    for r in rows:
        p = tok.encode(r["prompt"])
        call = _greedy(model, [p], tok.eos_id, 10)[0]
        text = tok.decode([t for t in call if t != tok.eos_id])
        m = CALL.match(text)
        if not (m and call and call[-1] == tok.eos_id):
            continue
        ctx = p + call + tok.encode(_calculator(m.group(1)) + "=")
        ans = _greedy(model, [ctx], tok.eos_id, 6)[0]
        correct += int(bool(ans) and ans[-1] == tok.eos_id and tok.decode(ans[:-1]) == r["answer"])
    return correct / max(len(rows), 1)


def episode_tokens(tok, row: dict) -> tuple[list[int], list[int]]:
    """``(ids, loss_mask)`` of one ideal episode: the model's pieces, each followed by eos,
    are trained on; the question and the tool's result are not."""
    ids, mask = [], []
    for text, mine in episode_text(row["prompt"], row["answer"]):
        piece = tok.encode(text) + ([tok.eos_id] if mine else [])
        ids += piece
        mask += [int(mine)] * len(piece)
    return ids, mask


def ensure_tools_assets(cache_dir: str | os.PathLike = ".cache/demo", rebuild: bool = False) -> Path:
    """The packaged or cached tool-demo assets, else built (``tokenizer/``, ``hf/``,
    ``train.jsonl``, ``eval.jsonl``, ``warm_start.json``)."""

    def build(tmp: Path) -> float:
        from grpo_mega.data.tokenizer import load_tokenizer
        from grpo_mega.testing.tiny import build_tiny_hf_checkpoint

        say("step 1/3: a character-level tokenizer with the demo's chat template")
        tok_dir = _build_tokenizer(tmp)
        tok = load_tokenizer(tok_dir)
        train, evals = problems()
        _write_jsonl(tmp / "train.jsonl", train)
        _write_jsonl(tmp / "eval.jsonl", evals)
        say(f"step 2/3: a tiny qwen2 (vocab {tok.vocab_size}, hidden 128, 2 layers)")
        hf = build_tiny_hf_checkpoint(tmp / "hf", family="qwen2", hidden_size=128, num_layers=2, num_heads=4,
                                      num_kv_heads=2, tokenizer_dir=tok_dir, seed=0, max_position_embeddings=64,
                                      intermediate_size=256)
        say("step 3/3: supervised warm start on whole episodes (stops at 30-50% held-out accuracy)")
        # lr 1e-3 jumped 0% -> 83% in 25 steps, past TARGET_ACC's window
        return supervised_warm_start(hf, tok, train, evals, episode_tokens, greedy_accuracy,
                                     lr=3e-4, check_every=4)

    return cached_build(VERSION, cache_dir, rebuild, "tool-use demo model and data", build)

if __name__ == "__main__":
    ensure_tools_assets(sys.argv[1] if len(sys.argv) > 1 else ".cache/demo", rebuild=True)
