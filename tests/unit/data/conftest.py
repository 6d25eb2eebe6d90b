"""Shared fixtures of the data tests: one tiny tokenizer per chat-template family, built
once per session (one BPE training, five copies with each family's special tokens and
reference template)."""
from __future__ import annotations

import pytest

FAMILIES = ("chatml", "qwen3", "llama3", "mistral", "gemma")


@pytest.fixture(scope="session")
def chat_tokenizers(tmp_path_factory):
    """``{family: HFTokenizer}`` for the five reference chat templates."""
    from grpo_mega.data.chat.templates import chat_corpus, write_chat_tokenizer
    from grpo_mega.data.tokenizer import HFTokenizer, train_bpe_tokenizer

    root = tmp_path_factory.mktemp("chat_tokenizers")
    base = train_bpe_tokenizer(chat_corpus(), root / "base", vocab_size=400)
    return {f: HFTokenizer(write_chat_tokenizer(f, root / f, base_dir=base)) for f in FAMILIES}
