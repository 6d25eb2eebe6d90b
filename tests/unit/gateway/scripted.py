"""A scripted tiny model for the gateway tests (real weights vLLM runs, known log-probs).

``build_scripted_model`` writes a Qwen2 checkpoint with the ChatML tokenizer of
``grpo_mega.data.chat.templates`` (its template, special tokens and tool-call tags) plus
one added token holding a whole tool call, and weights that make it a *class bigram*
model, so that a random-init model's useless output is replaced by one that exercises what
the gateway must handle, with log-probs known exactly:

* attention and MLP outputs are zero (``o_proj``, ``down_proj``), so the final hidden state
  is the current token's embedding, ``sqrt(H) * onehot(class(token))``;
* ``lm_head`` maps each class to fixed logits (``Scripted.logits``), so the next-token
  distribution depends only on the class of the current token.

After the generation prompt (its last token, ``\\n``, is class ``gen``) the model writes,
with even odds, a tool call (the added token: ``<tool_call>...</tool_call>`` in one, then
``<|im_end|>``) or "junk": lone UTF-8 continuation bytes, which decode to U+FFFD and
re-encode to *other* ids, until ``<|im_end|>`` (p=0.35 per token). So a re-tokenized
history differs from what was sampled, and every turn ends in one of the ways an agent
sees: a tool call, a text reply, or a cut at ``max_tokens``.
"""
from __future__ import annotations

import math
import shutil
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
    """The chat package's tiny ChatML tokenizer plus the whole tool-call text as one added
    token, with ``<|endoftext|>`` as eos."""
    from grpo_mega.data.chat.templates import write_chat_tokenizer
    from grpo_mega.data.tokenizer import HFTokenizer

    d = write_chat_tokenizer("chatml", out_dir)
    hf = HFTokenizer(d).hf
    hf.add_tokens([CALL_TEXT])
    # eos is not the end-of-turn token (as in Llama 3 base models): a turn ends at
    # <|im_end|> only because the gateway makes the chat format's end of turn a stop token.
    hf.eos_token = "<|endoftext|>"
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
    # transformers 5 saves the template as chat_template.jinja, which the checkpoint builder
    # does not copy (its TOKENIZER_FILES predate it).
    shutil.copyfile(tok_dir / "chat_template.jinja", model / "chat_template.jinja")
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
