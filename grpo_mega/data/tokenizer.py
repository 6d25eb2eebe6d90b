"""Tokenizers behind one small interface, plus tools to make tiny local ones.

What: the trainer, the prompt dataset and the reward code only need
``encode``, ``decode``, ``eos_id``, ``pad_id``, ``bos_id`` and ``vocab_size``.
Two backends provide them:

* :class:`HFTokenizer` wraps a Hugging Face tokenizer directory
  (``tokenizer.json`` / ``tokenizer_config.json``), the format vLLM loads;
* :class:`SentencePieceTokenizer` wraps a raw sentencepiece ``.model`` file.

:func:`load_tokenizer` picks the backend from the path.

Why the tools: the HF hub is unreachable here, so tiny test models use a
tokenizer trained locally. :func:`train_sentencepiece` trains one from a list
of strings, and :func:`write_hf_tokenizer_dir` turns the ``.model`` into an HF
tokenizer directory (a Llama-style sentencepiece tokenizer saved with
``save_pretrained``, which writes ``tokenizer.json``) so that transformers and
vLLM load it offline with the same ids as the raw sentencepiece model.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterable, Protocol, Sequence, runtime_checkable

__all__ = [
    "Tokenizer",
    "SentencePieceTokenizer",
    "HFTokenizer",
    "load_tokenizer",
    "check_tokenizer_dir",
    "TokenizerError",
    "TOKENIZER_FILES",
    "train_sentencepiece",
    "write_hf_tokenizer_dir",
    "train_bpe_tokenizer",
    "SPECIAL_PIECES",
]

# Ids of the special pieces in every tokenizer trained by train_sentencepiece.
# Fixed so that a model config can be written without reading the tokenizer.
SPECIAL_PIECES = {"unk": (0, "<unk>"), "bos": (1, "<s>"), "eos": (2, "</s>"), "pad": (3, "<pad>")}


@runtime_checkable
class Tokenizer(Protocol):
    """The interface the rest of grpo_mega relies on."""

    def encode(self, text: str, add_bos: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def bos_id(self) -> int | None: ...

    @property
    def vocab_size(self) -> int: ...


class SentencePieceTokenizer:
    """A raw sentencepiece model (``.model`` file)."""

    def __init__(self, model_file: str | os.PathLike):
        import sentencepiece as spm

        self.path = Path(model_file)
        self._sp = spm.SentencePieceProcessor(model_file=str(self.path))

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = list(self._sp.encode(text))
        return [self.bos_id, *ids] if add_bos and self.bos_id is not None else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            special = {self._sp.bos_id(), self._sp.eos_id(), self._sp.pad_id()}
            ids = [i for i in ids if i not in special]
        return self._sp.decode(ids)

    @property
    def eos_id(self) -> int:
        return int(self._sp.eos_id())

    @property
    def pad_id(self) -> int:
        # sentencepiece reports -1 when the model has no pad piece; fall back to
        # eos (padding positions are always masked, so the id only has to exist).
        pad = int(self._sp.pad_id())
        return pad if pad >= 0 else self.eos_id

    @property
    def bos_id(self) -> int | None:
        bos = int(self._sp.bos_id())
        return bos if bos >= 0 else None

    @property
    def vocab_size(self) -> int:
        return int(self._sp.get_piece_size())

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


class HFTokenizer:
    """A Hugging Face tokenizer directory, loaded offline with AutoTokenizer."""

    def __init__(self, path: str | os.PathLike, trust_remote_code: bool = False):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub
        from transformers import AutoTokenizer

        self.path = Path(path)
        self.hf = AutoTokenizer.from_pretrained(str(self.path), trust_remote_code=trust_remote_code)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = list(self.hf.encode(text, add_special_tokens=False))
        return [self.bos_id, *ids] if add_bos and self.bos_id is not None else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    @property
    def eos_id(self) -> int:
        if self.hf.eos_token_id is None:
            raise ValueError(f"tokenizer {self.path} defines no eos token")
        return int(self.hf.eos_token_id)

    @property
    def pad_id(self) -> int:
        pad = self.hf.pad_token_id
        return int(pad) if pad is not None else self.eos_id

    @property
    def bos_id(self) -> int | None:
        bos = self.hf.bos_token_id
        return int(bos) if bos is not None else None

    @property
    def vocab_size(self) -> int:
        # len() counts added tokens too; hf.vocab_size does not.
        return len(self.hf)

    @property
    def chat_template(self) -> str | None:
        return getattr(self.hf, "chat_template", None)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


class TokenizerError(ValueError):
    """A tokenizer path that would not give the model's vocabulary; the message names the
    folder and the files expected."""


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model")
"""Files that hold a vocabulary in an HF tokenizer directory (fast, sentencepiece, BPE with
``merges.txt``, WordPiece). Without any, transformers builds a tokenizer of 1 token from the
model's config alone, without a word, and the run fails later with a misleading error."""


def check_tokenizer_dir(path: str | os.PathLike) -> None:
    """TokenizerError unless directory ``path`` holds one of ``TOKENIZER_FILES``. Cheap (no
    transformers import): the launcher's pre-check runs it before any rank starts."""
    p = Path(path)
    if p.is_dir() and not any((p / f).is_file() for f in TOKENIZER_FILES):
        raise TokenizerError(f"model folder {str(p)!r} has no tokenizer files (expected one of "
                             f"{', '.join(TOKENIZER_FILES)}); copy the tokenizer saved with the "
                             "model into it (--model.hf_checkpoint)")


def load_tokenizer(path: str | os.PathLike) -> SentencePieceTokenizer | HFTokenizer:
    """A directory is an HF tokenizer; a ``.model`` file is raw sentencepiece. A directory
    without tokenizer files, or one whose tokenizer has a vocabulary of 1, is refused."""
    p = Path(path)
    if p.is_dir():
        check_tokenizer_dir(p)
        tok = HFTokenizer(p)
        if tok.vocab_size <= 1:
            raise TokenizerError(f"the tokenizer in {str(p)!r} loads with a vocabulary of {tok.vocab_size}; "
                                 f"its files ({', '.join(f for f in TOKENIZER_FILES if (p / f).is_file())}) "
                                 "hold no vocabulary (--model.hf_checkpoint)")
        return tok
    if p.is_file():
        return SentencePieceTokenizer(p)
    raise FileNotFoundError(f"tokenizer path {str(p)!r} is neither a directory nor a file")


def train_sentencepiece(
    texts: Iterable[str],
    out_prefix: str | os.PathLike,
    vocab_size: int,
    model_type: str = "bpe",
    character_coverage: float = 1.0,
    byte_fallback: bool = True,
    user_defined_symbols: Sequence[str] = (),
    seed_sentencepiece_size: int | None = None,
) -> Path:
    """Train a sentencepiece model on ``texts``; returns ``<out_prefix>.model``.

    Special ids are fixed (see ``SPECIAL_PIECES``): unk=0, bos=1, eos=2, pad=3.
    ``byte_fallback`` (default on) makes every string encodable, so a test can
    never hit an unknown character. ``vocab_size`` must exceed 4 + 256 when it
    is on (the byte pieces). Training is deterministic for the same inputs.
    """
    import sentencepiece as spm

    texts = [t for t in texts if t]
    if not texts:
        raise ValueError("train_sentencepiece needs at least one non-empty text")
    out_prefix = Path(out_prefix)
    out_prefix.parent.mkdir(parents=True, exist_ok=True)
    kwargs = dict(
        sentence_iterator=iter(texts),
        model_prefix=str(out_prefix),
        vocab_size=int(vocab_size),
        model_type=model_type,
        character_coverage=character_coverage,
        byte_fallback=byte_fallback,
        user_defined_symbols=list(user_defined_symbols),
        unk_id=SPECIAL_PIECES["unk"][0], bos_id=SPECIAL_PIECES["bos"][0],
        eos_id=SPECIAL_PIECES["eos"][0], pad_id=SPECIAL_PIECES["pad"][0],
        unk_piece=SPECIAL_PIECES["unk"][1], bos_piece=SPECIAL_PIECES["bos"][1],
        eos_piece=SPECIAL_PIECES["eos"][1], pad_piece=SPECIAL_PIECES["pad"][1],
        # A tiny corpus cannot support a large vocab; let the trainer stop
        # early instead of erroring, and keep whitespace/digits as pieces the
        # math rewards can read back.
        hard_vocab_limit=False,
        split_digits=True,
        # Keep text byte-exact: the default NFKC rule collapses repeated
        # spaces and turns newlines into spaces, which the HF conversion does
        # not do, so the two tokenizers would disagree.
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        # No dummy "▁" prefix: HF's Metaspace handles a leading space
        # differently from sentencepiece, so the only way to agree on every
        # string is to prepend nothing (add_prefix_space=False on the HF side).
        add_dummy_prefix=False,
        num_threads=1,
        minloglevel=2,
    )
    if seed_sentencepiece_size is not None:
        kwargs["seed_sentencepiece_size"] = seed_sentencepiece_size
    spm.SentencePieceTrainer.train(**kwargs)
    return out_prefix.with_suffix(".model")


def write_hf_tokenizer_dir(
    sp_model: str | os.PathLike,
    out_dir: str | os.PathLike,
    chat_template: str | None = None,
    model_max_length: int = 4096,
) -> Path:
    """Write an HF tokenizer directory for a sentencepiece model.

    transformers' Llama tokenizer converts the sentencepiece model (vocab,
    merges, byte fallback); the pre-tokenizer and decoder are then pinned to
    match :func:`train_sentencepiece` (no dummy-prefix space), and the result
    is saved as ``tokenizer.json`` with ``tokenizer_class =
    "PreTrainedTokenizerFast"`` so that every loader (``AutoTokenizer``,
    vLLM, transformers 4 or 5) reads the file verbatim instead of rebuilding
    the pipeline from class defaults. No bos is prepended on encode, the same
    as ``SentencePieceTokenizer``. Returns ``out_dir``.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tokenizers import decoders, pre_tokenizers
    from transformers import AutoTokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(sp_model, out / "tokenizer.model")
    special = {f"{name}_token": piece for name, (_, piece) in SPECIAL_PIECES.items()}
    (out / "tokenizer.json").unlink(missing_ok=True)  # force a fresh conversion
    _write_json(out / "tokenizer_config.json",
                {"tokenizer_class": "LlamaTokenizer", "legacy": False, "add_bos_token": False,
                 "add_eos_token": False, **special})
    tok = AutoTokenizer.from_pretrained(str(out))
    backend = tok.backend_tokenizer
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never",
                                                     split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                         decoders.Fuse()])
    backend.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
              "clean_up_tokenization_spaces": False, **special}
    _write_tokenizer_config(out, config, special, chat_template)
    return out


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _write_tokenizer_config(out: Path, config: dict, special: dict, chat_template: str | None) -> None:
    """tokenizer_config.json (with the chat template, if any) and special_tokens_map.json."""
    if chat_template is not None:
        config = dict(config, chat_template=chat_template)
    _write_json(out / "tokenizer_config.json", config)
    _write_json(out / "special_tokens_map.json", special)


# Qwen2's pre-tokenizer split (transformers' Qwen2Tokenizer.PRETOKENIZE_REGEX).
QWEN2_PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
                           r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


def train_bpe_tokenizer(
    texts: Iterable[str],
    out_dir: str | os.PathLike,
    vocab_size: int,
    chat_template: str | None = None,
    model_max_length: int = 4096,
) -> Path:
    """Train a byte-level BPE tokenizer in Qwen2's format; returns ``out_dir``.

    Why a second trainer: transformers 5 ignores ``tokenizer_class`` for a
    model whose config says ``model_type: qwen2`` and rebuilds the pipeline
    of ``Qwen2Tokenizer`` (NFC, Qwen2's regex split, byte-level BPE) from the
    vocab and merges. A sentencepiece-style vocab then encodes and decodes
    garbage, in transformers and in vLLM alike. So a tiny Qwen2 checkpoint
    needs a tokenizer trained for exactly that pipeline, which this builds
    with the ``tokenizers`` library. Special ids match ``SPECIAL_PIECES``
    (unk=0, bos=1, eos=2, pad=3); no bos is prepended on encode. The vocab
    always contains the 256 byte symbols, so every string is encodable.
    """
    from tokenizers import Regex, Tokenizer as RustTokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers, trainers

    texts = [t for t in texts if t]
    if not texts:
        raise ValueError("train_bpe_tokenizer needs at least one non-empty text")
    specials = [piece for _, piece in sorted(SPECIAL_PIECES.values())]
    tok = RustTokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=int(vocab_size), special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    tok.model.save(str(out))  # vocab.json + merges.txt, what Qwen2Tokenizer rebuilds from
    special = {f"{name}_token": piece for name, (_, piece) in SPECIAL_PIECES.items()}
    config = {"tokenizer_class": "Qwen2Tokenizer", "model_max_length": model_max_length,
              "clean_up_tokenization_spaces": False, "add_prefix_space": False,
              "add_bos_token": False, **special}
    _write_tokenizer_config(out, config, special, chat_template)
    return out
