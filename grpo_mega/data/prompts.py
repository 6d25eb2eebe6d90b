"""Prompt datasets for rollouts: JSONL / Parquet rows -> tokenized prompts.

What: :class:`PromptDataset` reads rows from JSONL and Parquet files, takes
the prompt, the reference answer and optional metadata from configurable
fields, renders the prompt (raw text, a ``{prompt}`` format string, a Jinja
chat template, or the tokenizer's own chat template), tokenizes it, and
serves batches in an order fixed by ``(seed, epoch)``. A row may hold chat
``messages`` (a list of ``{role, content}``) instead of a prompt; those are
rendered with the tokenizer's chat template, as an instruct model expects.

Why the rules:
* Prompts longer than ``max_prompt_tokens`` are skipped and counted (and
  logged), never truncated: a truncated math question is a different
  question with a wrong reference answer.
* The order is a pure function of ``(seed, epoch)`` and the position is a
  pair ``(epoch, offset)``, so ``state_dict``/``load_state_dict`` let a
  resumed run see exactly the prompts an uninterrupted run would. Every rank
  builds the same dataset and draws the same global batch; a data-parallel
  replica then takes its slice with :func:`shard_for_replica` (no
  communication needed).
* Bad input fails loudly before any engine starts: a malformed JSONL line is
  reported with its file and line number, a missing field by name, and an
  empty (or entirely filtered) dataset with the counts.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence, TypeVar

from grpo_mega.data.tokenizer import Tokenizer

__all__ = ["DataError", "Prompt", "PromptDataset", "read_rows", "render_messages", "render_prompt",
           "shard_for_replica"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class DataError(ValueError):
    """Bad or empty prompt data; the message names file, line and field."""


@dataclass(frozen=True)
class Prompt:
    uid: str
    """Stable id: ``<file name>:<row number>`` (1-based line for JSONL)."""
    text: str
    """The rendered prompt exactly as tokenized (chat template applied)."""
    token_ids: tuple[int, ...]
    reference: str | None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    messages: tuple = ()
    """The row's chat messages before any template (``[{"role": "user", "content": prompt}]``
    for a string prompt): what a multi-turn environment's ``reset`` reads."""


# ---------------------------------------------------------------------------
# Reading rows: one reader per file format, keyed by suffix
# ---------------------------------------------------------------------------

Row = tuple[str, str, dict]  # (location for error messages, stable uid, the row)


def _read_jsonl(path: Path) -> Iterator[Row]:
    with path.open("r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise DataError(f"{where}: expected a JSON object per line, got {type(row).__name__}")
            yield where, f"{path.name}:{lineno}", row


def _read_parquet(path: Path) -> Iterator[Row]:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    for i, row in enumerate(table.to_pylist()):
        yield f"{path}:row {i}", f"{path.name}:{i}", row


READERS: dict[str, Callable[[Path], Iterator[Row]]] = {
    ".jsonl": _read_jsonl,
    ".json": _read_jsonl,  # one object per line, as JSONL
    ".parquet": _read_parquet,
}


def read_rows(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> Iterator[Row]:
    """Rows of every file in ``paths``, in the order given."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not paths:
        raise DataError("no data files given (set data paths)")
    for p in map(Path, paths):
        if not p.is_file():
            raise DataError(f"data file {str(p)!r} does not exist")
        reader = READERS.get(p.suffix.lower())
        if reader is None:
            raise DataError(f"data file {str(p)!r}: unknown format {p.suffix!r}; "
                            f"supported: {sorted(READERS)}")
        yield from reader(p)


# ---------------------------------------------------------------------------
# Rendering prompts
# ---------------------------------------------------------------------------

def _messages(prompt: Any, system_prompt: str | None, where: str) -> list[dict]:
    if isinstance(prompt, str):
        msgs = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m and "content" in m
                                          for m in prompt):
        msgs = [dict(m) for m in prompt]
    else:
        raise DataError(f"{where}: prompt must be a string or a list of "
                        f"{{'role', 'content'}} messages, got {type(prompt).__name__}")
    if system_prompt and msgs[0]["role"] != "system":
        msgs.insert(0, {"role": "system", "content": system_prompt})
    return msgs


def _check_messages(msgs: Any, where: str, messages_field: str) -> list[dict]:
    if not (isinstance(msgs, list) and msgs and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in msgs)):
        raise DataError(f"{where}: field {messages_field!r} must be a non-empty list of "
                        "{'role': str, 'content': str} messages")
    if msgs[-1]["role"] == "assistant":
        # The generation prompt opens a new assistant turn; a trailing
        # assistant message would be the answer itself inside the prompt.
        raise DataError(f"{where}: field {messages_field!r} ends with an assistant message; "
                        "a prompt must end with the turn the model answers (drop the reply)")
    return [dict(m) for m in msgs]


def render_messages(msgs: list[dict], chat_template: str | None, tokenizer: Tokenizer | None,
                    system_prompt: str | None = None, where: str = "messages",
                    messages_field: str = "messages") -> str:
    """The text of a chat-formatted row: ``chat_template`` when set, else the
    tokenizer's own template (``apply_chat_template(..., add_generation_prompt=True)``)."""
    msgs = _check_messages(msgs, where, messages_field)
    if chat_template is not None:
        return render_prompt(msgs, chat_template, tokenizer, system_prompt, where)
    hf = getattr(tokenizer, "hf", None)
    if hf is None or not getattr(hf, "chat_template", None):
        raise DataError(f"{where}: row holds chat {messages_field!r} but the tokenizer {tokenizer!r} "
                        "has no chat template; use a tokenizer (model.hf_checkpoint) whose "
                        "tokenizer_config.json has a chat_template, or set data.chat_template to a "
                        "Jinja template")
    return render_prompt(msgs, "tokenizer", tokenizer, system_prompt, where)


def _is_jinja(template: str) -> bool:
    return "{{" in template or "{%" in template


def render_prompt(prompt: Any, chat_template: str | None, tokenizer: Tokenizer | None = None,
                  system_prompt: str | None = None, where: str = "prompt") -> str:
    """The text the model sees.

    chat_template:
      * ``None``: the prompt string unchanged (chat messages are an error);
      * ``"tokenizer"``: the HF tokenizer's own chat template;
      * a Jinja template (contains ``{{`` or ``{%``), rendered with
        ``messages``, ``add_generation_prompt=True``, ``bos_token``, ``eos_token``;
      * otherwise a format string with a ``{prompt}`` field (and optionally
        ``{system}``), e.g. ``"Question: {prompt}\\nAnswer:"``.
    """
    if chat_template is None:
        if not isinstance(prompt, str):
            raise DataError(f"{where}: prompt is a list of chat messages; set a chat_template")
        return prompt
    msgs = _messages(prompt, system_prompt, where)
    if chat_template == "tokenizer":
        hf = getattr(tokenizer, "hf", None)
        if hf is None or not getattr(hf, "chat_template", None):
            raise DataError("chat_template='tokenizer' needs an HF tokenizer that has a chat template")
        return hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    if _is_jinja(chat_template):
        return _render_jinja(chat_template, msgs, tokenizer)
    if "{prompt}" not in chat_template:
        raise DataError(f"chat_template {chat_template!r} is neither Jinja nor a format string "
                        "with a {prompt} field")
    if len(msgs) > 2 or msgs[-1]["role"] != "user":
        raise DataError(f"{where}: a format-string chat_template takes a single user message")
    system = msgs[0]["content"] if msgs[0]["role"] == "system" else (system_prompt or "")
    return chat_template.format(prompt=msgs[-1]["content"], system=system)


def _render_jinja(template: str, msgs: list[dict], tokenizer: Tokenizer | None) -> str:
    import jinja2

    def special(id_attr: str) -> str:
        tid = getattr(tokenizer, id_attr, None) if tokenizer is not None else None
        return tokenizer.decode([tid], skip_special_tokens=False) if tid is not None else ""

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
    return env.from_string(template).render(
        messages=msgs, add_generation_prompt=True,
        bos_token=special("bos_id"), eos_token=special("eos_id"))


# ---------------------------------------------------------------------------
# The dataset
# ---------------------------------------------------------------------------

def _field(row: dict, name: str, where: str, kind: str) -> Any:
    if name not in row:
        raise DataError(f"{where}: missing field {name!r} (fields present: {sorted(row)}); "
                        f"set data {kind}_field to the right name")
    value = row[name]
    if value is None:
        raise DataError(f"{where}: field {name!r} is null")
    return value


class PromptDataset:
    """Tokenized prompts served in a deterministic, resumable order.

    Usage::

        ds = PromptDataset("train.jsonl", tokenizer, prompt_field="question",
                           reference_field="answer", max_prompt_tokens=512, seed=1)
        batch = ds.next_batch(64)          # same 64 prompts on every rank
        mine = shard_for_replica(batch, dp_rank, dp_size)
        state = ds.state_dict()            # store in the checkpoint
    """

    def __init__(
        self,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        tokenizer: Tokenizer,
        *,
        prompt_field: str = "prompt",
        messages_field: str | None = "messages",
        reference_field: str | None = "answer",
        metadata_fields: Sequence[str] | None = None,
        chat_template: str | None = None,
        system_prompt: str | None = None,
        add_bos: bool = False,
        max_prompt_tokens: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
    ):
        """
        Args:
            paths: JSONL (``.jsonl``/``.json``) and Parquet files, read in order.
            prompt_field: field holding the prompt (a string or chat messages).
            messages_field: a row without ``prompt_field`` may hold chat
                messages here instead, rendered by :func:`render_messages`
                (the tokenizer's chat template unless ``chat_template`` is
                set); ``None`` disables the fallback.
            reference_field: field with the reference answer; ``None`` if the
                rewards need none. Missing in a row is an error.
            metadata_fields: fields copied into ``Prompt.metadata``;
                ``None`` copies none, ``["*"]`` copies every other field.
            chat_template: see :func:`render_prompt`.
            max_prompt_tokens: prompts with more tokens are skipped and counted.
            seed: the order of epoch e is a permutation fixed by (seed, e).
        """
        self.paths = [str(p) for p in ([paths] if isinstance(paths, (str, os.PathLike)) else paths)]
        self.seed = int(seed)
        self.shuffle = shuffle
        self.max_prompt_tokens = max_prompt_tokens
        self.num_rows = 0
        self.num_skipped_too_long = 0
        self.prompts: list[Prompt] = []
        for where, uid, row in read_rows(self.paths):
            self.num_rows += 1
            prompt = self._make_prompt(where, uid, row, tokenizer, prompt_field, messages_field,
                                       reference_field, metadata_fields, chat_template,
                                       system_prompt, add_bos)
            if max_prompt_tokens is not None and len(prompt.token_ids) > max_prompt_tokens:
                self.num_skipped_too_long += 1
                continue
            self.prompts.append(prompt)
        self._check_not_empty()
        if self.num_skipped_too_long:
            log.warning("data: skipped %d of %d prompts longer than max_prompt_tokens=%d",
                        self.num_skipped_too_long, self.num_rows, max_prompt_tokens)
        self.fingerprint = self._fingerprint()
        self.epoch = 0
        self.offset = 0
        self._order_cache: tuple[int, list[int]] | None = None

    @staticmethod
    def _make_prompt(where, uid, row, tokenizer, prompt_field, messages_field, reference_field,
                     metadata_fields, chat_template, system_prompt, add_bos) -> Prompt:
        if prompt_field not in row and messages_field is not None and messages_field in row:
            messages = tuple(_check_messages(row[messages_field], where, messages_field))
            text = render_messages(row[messages_field], chat_template, tokenizer, system_prompt,
                                   where, messages_field)
        else:
            if prompt_field not in row and messages_field is not None:
                raise DataError(f"{where}: missing field {prompt_field!r} and no chat "
                                f"{messages_field!r} field either (fields present: {sorted(row)}); "
                                "set data prompt_field (data.prompt_key) or data.messages_key "
                                "to the right name")
            raw = _field(row, prompt_field, where, "prompt")
            if isinstance(raw, str) and not raw.strip():
                # A template would wrap it into a non-empty request that asks nothing.
                raise DataError(f"{where}: field {prompt_field!r} is an empty prompt; remove the row "
                                "or fill it in")
            text = render_prompt(raw, chat_template, tokenizer, system_prompt, where)
            messages = tuple(_messages(raw, system_prompt, where))
        reference = None
        if reference_field is not None:
            reference = str(_field(row, reference_field, where, "reference"))
        if metadata_fields is None:
            meta = {}
        elif list(metadata_fields) == ["*"]:
            meta = {k: v for k, v in row.items()
                    if k not in (prompt_field, messages_field, reference_field)}
        else:
            meta = {k: _field(row, k, where, "metadata") for k in metadata_fields}
        ids = tuple(tokenizer.encode(text, add_bos=add_bos))
        if not ids:  # the engine refuses an empty request mid-run, on some rank
            raise DataError(f"{where}: the prompt {text!r} encodes to no tokens; remove the row or fill it in")
        return Prompt(uid, text, ids, reference, meta, messages)

    def _check_not_empty(self) -> None:
        if self.prompts:
            return
        if self.num_rows == 0:
            raise DataError(f"dataset {self.paths} is empty: no rows read")
        raise DataError(f"dataset {self.paths} has no usable prompts: all {self.num_rows} rows are "
                        f"longer than max_prompt_tokens={self.max_prompt_tokens}")

    def _fingerprint(self) -> str:
        h = hashlib.sha256()
        for p in self.prompts:
            h.update(p.uid.encode())
            h.update(len(p.token_ids).to_bytes(4, "little"))
            h.update(",".join(map(str, p.token_ids)).encode())
        return h.hexdigest()[:16]

    # -- order -----------------------------------------------------------
    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> Prompt:
        return self.prompts[i]

    def epoch_order(self, epoch: int) -> list[int]:
        """Indices of epoch ``epoch``: a permutation fixed by (seed, epoch)."""
        if self._order_cache is not None and self._order_cache[0] == epoch:
            return self._order_cache[1]
        order = list(range(len(self.prompts)))
        if self.shuffle:
            # A string seed hashes with SHA-512: stable across runs and
            # Python versions (unlike hash()).
            random.Random(f"grpo-mega:{self.seed}:{epoch}").shuffle(order)
        self._order_cache = (epoch, order)
        return order

    def next_batch(self, batch_size: int) -> list[Prompt]:
        """The next ``batch_size`` prompts; an epoch's tail continues into the
        next epoch's head, so no prompt is ever dropped."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        out = []
        while len(out) < batch_size:
            order = self.epoch_order(self.epoch)
            take = min(batch_size - len(out), len(order) - self.offset)
            out.extend(self.prompts[i] for i in order[self.offset:self.offset + take])
            self.offset += take
            if self.offset == len(order):
                self.epoch, self.offset = self.epoch + 1, 0
        return out

    # -- resume ----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed,
                "shuffle": self.shuffle, "num_prompts": len(self.prompts),
                "fingerprint": self.fingerprint}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the position. The data, filter and seed must be the same as
        when the state was saved, otherwise the resumed order would differ."""
        for key in ("seed", "shuffle", "num_prompts", "fingerprint"):
            mine = self.state_dict()[key]
            if state.get(key) != mine:
                raise DataError(f"cannot resume data position: saved {key}={state.get(key)!r} "
                                f"but this dataset has {key}={mine!r} (data files, fields, "
                                "tokenizer, max_prompt_tokens and seed must match)")
        if not 0 <= int(state["offset"]) < len(self.prompts):
            raise DataError(f"saved data offset {state['offset']} out of range")
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])

    @property
    def stats(self) -> dict[str, int]:
        return {"rows": self.num_rows, "prompts": len(self.prompts),
                "skipped_too_long": self.num_skipped_too_long}


def shard_for_replica(items: Sequence[T], dp_rank: int, dp_size: int) -> list[T]:
    """Replica ``dp_rank``'s contiguous slice of a global batch.

    Sizes differ by at most one (the first ``len % dp_size`` replicas get the
    extra item); concatenating all slices in rank order gives ``items`` back.
    """
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} not in [0, {dp_size})")
    base, extra = divmod(len(items), dp_size)
    start = dp_rank * base + min(dp_rank, extra)
    return list(items[start:start + base + (dp_rank < extra)])
