"""Test fixtures for the gateway tests: a scripted tiny model and a ChatML turn codec.

TEST FIXTURE ONLY. ``ChatMLFixtureCodec`` stands in for ``grpo_mega.data.chat`` (the chat
formats, built on another branch) until that lands; it implements the ``TurnCodec``
protocol of ``grpo_mega.rollout.multi_turn`` for a Qwen-style ChatML format, simply.

``build_scripted_model`` writes a real Qwen2 checkpoint (vLLM loads and runs it) whose
weights make it a *class bigram* model, so that a random-init model's useless output is
replaced by one that exercises what the gateway must handle, with log-probs known exactly:

* attention and MLP outputs are zero (``o_proj``, ``down_proj``), so the final hidden state
  is the current token's embedding, ``sqrt(H) * onehot(class(token))``;
* ``lm_head`` maps each class to fixed logits (``LOGITS``), so the next-token distribution
  depends only on the class of the current token.

After the generation prompt (its last token, ``\\n``, is class ``gen``) the model writes,
with even odds, a tool call (one added token holding the whole ``<tool_call>...</tool_call>``
text, then ``<|im_end|>``) or "junk": lone UTF-8 continuation bytes, which decode to U+FFFD
and re-encode to *other* ids, until ``<|im_end|>`` (p=0.35 per token). So a re-tokenized
history differs from what was sampled, and every turn ends in one of the ways an agent
sees: a tool call, a text reply, or a cut at ``max_tokens``.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

CALL_TEXT = '<tool_call>\n{"name": "lookup", "arguments": {"key": "x"}}\n</tool_call>'
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
GEN = IM_START + "assistant\n"
TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look a key up.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}]
JUNK_BYTES = [b for b in range(0xA1, 0xC0) if b != 0xAD]  # continuation bytes byte-level BPE shows as chr(b)
P_END_AFTER_JUNK = 0.35
BASE = 12.0  # logit of the scripted continuations; every other token has logit 0


class Scripted:
    """Token classes and the exact next-token log-probs of the scripted model."""

    def __init__(self, tok):
        self.tok = tok
        vocab = tok.hf.get_vocab()
        self.vocab_size = tok.vocab_size
        self.im_start, self.im_end = vocab[IM_START], vocab[IM_END]
        self.call = vocab[CALL_TEXT]
        self.newline = tok.encode(GEN)[-1]
        self.junk = [vocab[chr(b)] for b in JUNK_BYTES]
        self.classes = {"gen": 0, "call": 1, "junk": 2, "other": 3}
        logits = torch.zeros(4, self.vocab_size, dtype=torch.float64)
        logits[0, self.call] = BASE
        logits[0, self.junk] = BASE - math.log(len(self.junk))
        logits[1, self.im_end] = BASE
        logits[2, self.im_end] = BASE + math.log(P_END_AFTER_JUNK)
        logits[2, self.junk] = BASE + math.log((1 - P_END_AFTER_JUNK) / len(self.junk))
        self.logits = logits  # [4, V]; class "other" stays uniform

    def token_class(self, t: int) -> int:
        if t == self.newline:
            return 0
        if t == self.call:
            return 1
        if t in self.junk:
            return 2
        return 3

    def logprob(self, prev: int, token: int) -> float:
        """log p(token | prev) under the scripted model (the engine must report this)."""
        return float(torch.log_softmax(self.logits[self.token_class(prev)], -1)[token])


def build_scripted_tokenizer(out_dir: Path):
    """The tiny byte-level BPE of ``grpo_mega.testing.tiny`` plus ChatML's markers (special)
    and the whole tool-call text as one added token."""
    from grpo_mega.data.tokenizer import HFTokenizer
    from grpo_mega.testing.tiny import build_tiny_tokenizer

    d = build_tiny_tokenizer(out_dir, "qwen2", chat_template=None)
    hf = HFTokenizer(d).hf
    hf.add_special_tokens({"additional_special_tokens": [IM_START, IM_END]})
    hf.add_tokens([CALL_TEXT])
    hf.save_pretrained(str(d))
    return d


def build_scripted_model(root: Path) -> tuple[Path, Scripted]:
    """A Qwen2 checkpoint (1 layer, hidden 128, untied head) scripted as described above."""
    from safetensors.torch import load_file, save_file

    from grpo_mega.data.tokenizer import HFTokenizer
    from grpo_mega.testing.tiny import build_tiny_hf_checkpoint

    tok_dir = build_scripted_tokenizer(root / "tok")
    model = build_tiny_hf_checkpoint(root / "model", "qwen2", tokenizer_dir=tok_dir, num_layers=1,
                                     tie_word_embeddings=False, seed=0)
    script = Scripted(HFTokenizer(model))
    weights = load_file(model / "model.safetensors")
    hidden = weights["model.embed_tokens.weight"].shape[1]
    emb = torch.zeros_like(weights["model.embed_tokens.weight"])
    for t in range(emb.shape[0]):
        emb[t, script.token_class(t)] = math.sqrt(hidden)  # RMSNorm leaves it as it is
    head = torch.zeros_like(weights["lm_head.weight"])
    head[:, :4] = (script.logits.T / math.sqrt(hidden)).to(head.dtype)
    weights["model.embed_tokens.weight"], weights["lm_head.weight"] = emb, head
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(weights[name])
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    return model, script


class ChatMLFixtureCodec:
    """TEST FIXTURE: a ChatML ``TurnCodec`` (Qwen-style tool calls, consecutive tool results
    in one user turn). Replaced by ``grpo_mega.data.chat`` once that is merged."""

    def __init__(self, tok):
        self.tok = tok
        self.im_end = tok.hf.convert_tokens_to_ids(IM_END)

    def _turn(self, m: dict) -> str:
        if m["role"] == "assistant":
            calls = "".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                          "arguments": c["function"]["arguments"]})
                            + "\n</tool_call>" for c in m.get("tool_calls") or [])
            return f"{IM_START}assistant\n{m.get('content') or ''}{calls}{IM_END}\n"
        return f"{IM_START}{m['role']}\n{m.get('content') or ''}{IM_END}\n"

    def _turns(self, messages: list[dict]) -> str:
        out, i = [], 0
        while i < len(messages):
            if messages[i]["role"] == "tool":
                results = []
                while i < len(messages) and messages[i]["role"] == "tool":
                    results.append(f"<tool_response>\n{messages[i]['content']}\n</tool_response>")
                    i += 1
                out.append(f"{IM_START}user\n" + "\n".join(results) + f"{IM_END}\n")
            else:
                out.append(self._turn(messages[i]))
                i += 1
        return "".join(out)

    def render(self, messages: list[dict], tools: list[dict]) -> str:
        head = ""
        if tools:
            system = messages[0]["content"] if messages and messages[0]["role"] == "system" else ""
            head = (f"{IM_START}system\n{system}\n\n# Tools\n<tools>\n"
                    + "\n".join(json.dumps(t) for t in tools) + f"\n</tools>{IM_END}\n")
            if messages and messages[0]["role"] == "system":
                messages = messages[1:]
        return head + self._turns(messages)

    def first_ids(self, messages, tools):
        return self.tok.encode(self.render(messages, tools) + GEN)

    def delta_ids(self, history, new, tools):
        # The model's turn ended with <|im_end|>; ChatML puts "\n" after it.
        return self.tok.encode("\n" + self._turns(new) + GEN)

    def parse(self, ids):
        body = list(ids[:-1]) if ids and ids[-1] == self.im_end else list(ids)
        text = self.tok.decode(body, skip_special_tokens=False)
        calls = [json.loads(c) for c in re.findall(r"<tool_call>\n(.*?)\n</tool_call>", text, flags=re.S)]
        content = re.sub(r"<tool_call>\n.*?\n</tool_call>", "", text, flags=re.S)
        msg = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = [{"type": "function", "function": c} for c in calls]
        return msg

    def check(self, prompt_ids, segments, messages, tools):
        """Text-level: the decoded trajectory is the rendered conversation (a dropped or
        doubled separator, a missing delta); ids-level exactness is what the tests compare."""
        ids = list(prompt_ids) + [t for _, seg in segments for t in seg]
        closed = bool(ids) and ids[-1] == self.im_end  # a reply cut at max_tokens has no end marker
        got = self.tok.decode(ids, skip_special_tokens=False) + ("\n" if closed else IM_END + "\n")
        want = self.render(messages, tools)
        if got == want:
            return []
        at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        return [f"text differs at char {at}: {got[at:at + 30]!r} vs {want[at:at + 30]!r}"]
