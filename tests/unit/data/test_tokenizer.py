"""Tokenizers: locally trained sentencepiece / BPE models, the HF directories
written from them, and the one interface over both backends.
"""
from __future__ import annotations

import json

import pytest

from grpo_mega.data.tokenizer import (
    HFTokenizer, SPECIAL_PIECES, SentencePieceTokenizer, Tokenizer, load_tokenizer,
    train_bpe_tokenizer, train_sentencepiece, write_hf_tokenizer_dir,
)

CORPUS = [f"What is {a} + {b}?\nThe answer is {a + b}. #### {a + b}" for a in range(40) for b in range(0, 40, 3)]
CORPUS += ["Hello world, \\boxed{\\frac{1}{2}} and 1,234 apples.", "  indented line\ttab"]

# Strings that broke naive conversions: repeated/leading/trailing spaces
# (sentencepiece's NFKC collapses them), newlines (turned into spaces),
# non-ASCII (byte fallback), the empty string.
HARD_STRINGS = ["What is 3 + 4? The answer is 7.", "  two  spaces", " lead", "trail ", "a\nb\n\nc",
                "ünïcödé € 😀", "\\boxed{1/2}", "tab\there", ""]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("sp")
    return train_sentencepiece(CORPUS, out / "tok", vocab_size=400)


@pytest.fixture(scope="module")
def hf_dir(sp_model, tmp_path_factory):
    return write_hf_tokenizer_dir(sp_model, tmp_path_factory.mktemp("hf"),
                                  chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    return train_bpe_tokenizer(CORPUS, tmp_path_factory.mktemp("bpe"), vocab_size=400)


def test_sentencepiece_special_ids_are_fixed(sp_model):
    """The tiny checkpoints write bos/eos/pad ids without reading the tokenizer;
    guards against trainer defaults (pad=-1) changing them."""
    tok = SentencePieceTokenizer(sp_model)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (SPECIAL_PIECES["bos"][0], SPECIAL_PIECES["eos"][0],
                                                    SPECIAL_PIECES["pad"][0]) == (1, 2, 3)
    assert 260 < tok.vocab_size <= 400
    assert isinstance(tok, Tokenizer)


def test_sentencepiece_round_trips_text_byte_exact(sp_model):
    """Guards against the default NFKC normalisation, which collapsed spaces and
    turned newlines into spaces (reasoning text would change meaning)."""
    tok = SentencePieceTokenizer(sp_model)
    for s in HARD_STRINGS:
        assert tok.decode(tok.encode(s)) == s, repr(s)


def test_hf_dir_from_sentencepiece_encodes_identically(sp_model, hf_dir):
    """HF's Metaspace pre-tokenizer treated a leading space differently from
    sentencepiece's dummy prefix, so ids disagreed between the trainer's and
    vLLM's tokenizers; both must give the same ids on every string."""
    sp, hf = SentencePieceTokenizer(sp_model), HFTokenizer(hf_dir)
    assert hf.vocab_size == sp.vocab_size
    assert (hf.bos_id, hf.eos_id, hf.pad_id) == (sp.bos_id, sp.eos_id, sp.pad_id)
    for s in HARD_STRINGS:
        assert hf.encode(s) == sp.encode(s), repr(s)
        assert hf.decode(hf.encode(s)) == s, repr(s)


def test_hf_dir_is_self_describing(hf_dir):
    """AutoTokenizer must read tokenizer.json verbatim (PreTrainedTokenizerFast),
    not rebuild a Llama pipeline from class defaults."""
    cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (hf_dir / "tokenizer.json").is_file()
    assert HFTokenizer(hf_dir).chat_template.startswith("{% for m")


def test_encode_add_bos(sp_model, hf_dir):
    for tok in (SentencePieceTokenizer(sp_model), HFTokenizer(hf_dir)):
        assert tok.encode("hi", add_bos=True)[0] == 1
        assert tok.encode("hi")[0] != 1


def test_bpe_tokenizer_round_trips_and_fixes_special_ids(bpe_dir):
    tok = HFTokenizer(bpe_dir)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 3)
    for s in HARD_STRINGS:
        assert tok.decode(tok.encode(s)) == s, repr(s)


def test_load_tokenizer_picks_backend_by_path(sp_model, hf_dir, tmp_path):
    assert isinstance(load_tokenizer(sp_model), SentencePieceTokenizer)
    assert isinstance(load_tokenizer(hf_dir), HFTokenizer)
    with pytest.raises(FileNotFoundError, match="neither a directory nor a file"):
        load_tokenizer(tmp_path / "missing")


def test_train_sentencepiece_rejects_empty_corpus(tmp_path):
    with pytest.raises(ValueError, match="non-empty"):
        train_sentencepiece(["", ""], tmp_path / "x", vocab_size=300)
