"""Prompt datasets: JSONL/Parquet loading, field names, chat templates, the
length filter, deterministic resumable order, replica sharding, bad input.
"""
from __future__ import annotations

import json
import logging

import pytest

from grpo_mega.data import DataError, PromptDataset, render_prompt, shard_for_replica
from grpo_mega.data.tokenizer import SentencePieceTokenizer, train_sentencepiece

ROWS = [{"question": f"What is {i} + {i + 1}?", "answer": str(2 * i + 1), "level": i % 3, "src": "gen"}
        for i in range(23)]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    texts = [r["question"] for r in ROWS] + ["Question: Answer: User: Assistant: system"]
    model = train_sentencepiece(texts, tmp_path_factory.mktemp("sp") / "tok", vocab_size=300)
    return SentencePieceTokenizer(model)


def write_jsonl(path, rows, extra_lines=()):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "".join(extra_lines))
    return path


@pytest.fixture
def jsonl(tmp_path):
    return write_jsonl(tmp_path / "train.jsonl", ROWS)


def make(path, tok, **kw):
    kw.setdefault("prompt_field", "question")
    return PromptDataset(path, tok, **kw)


def test_jsonl_fields_reference_and_metadata(jsonl, tok):
    ds = make(jsonl, tok, metadata_fields=["level"])
    assert len(ds) == len(ROWS) and ds.stats == {"rows": 23, "prompts": 23, "skipped_too_long": 0}
    p = ds[5]
    assert (p.text, p.reference, dict(p.metadata)) == ("What is 5 + 6?", "11", {"level": 2})
    assert list(p.token_ids) == tok.encode("What is 5 + 6?")
    assert p.uid == "train.jsonl:6"  # 1-based line number
    everything = make(jsonl, tok, metadata_fields=["*"])[0].metadata
    assert dict(everything) == {"level": 0, "src": "gen"}


def test_parquet_loads_the_same_prompts_as_jsonl(jsonl, tok, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    a, b = make(jsonl, tok), make(path, tok)
    assert [(p.text, p.token_ids, p.reference) for p in a.prompts] == \
           [(p.text, p.token_ids, p.reference) for p in b.prompts]
    assert b[0].uid == "train.parquet:0"


def test_several_files_are_read_in_order(tmp_path, tok):
    f1 = write_jsonl(tmp_path / "a.jsonl", ROWS[:3])
    f2 = write_jsonl(tmp_path / "b.jsonl", ROWS[3:5])
    ds = make([f1, f2], tok, shuffle=False)
    assert [p.reference for p in ds.next_batch(5)] == [r["answer"] for r in ROWS[:5]]


def test_long_prompts_are_skipped_and_counted_never_truncated(jsonl, tok, caplog):
    """A truncated math question is a different question with a wrong answer:
    over-long prompts must be dropped, counted and logged."""
    lengths = sorted(len(tok.encode(r["question"])) for r in ROWS)
    limit = lengths[0]  # single-digit questions fit, longer ones do not
    with caplog.at_level(logging.WARNING, logger="grpo_mega.data"):
        ds = make(jsonl, tok, max_prompt_tokens=limit)
    too_long = sum(n > limit for n in lengths)
    assert ds.num_skipped_too_long == too_long > 0
    assert len(ds) == len(ROWS) - too_long
    assert all(list(p.token_ids) == tok.encode(p.text) and len(p.token_ids) <= limit for p in ds.prompts)
    assert f"skipped {too_long} of 23" in caplog.text


def test_all_prompts_too_long_is_a_clear_error(jsonl, tok):
    with pytest.raises(DataError, match="no usable prompts: all 23 rows are longer than max_prompt_tokens=1"):
        make(jsonl, tok, max_prompt_tokens=1)


def test_format_string_and_jinja_chat_templates(jsonl, tok):
    fmt = make(jsonl, tok, chat_template="Question: {prompt}\nAnswer:")
    assert fmt[0].text == "Question: What is 0 + 1?\nAnswer:"
    jinja = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
             "{% if add_generation_prompt %}assistant:{% endif %}")
    ds = make(jsonl, tok, chat_template=jinja, system_prompt="Be brief.")
    assert ds[0].text == "system: Be brief.\nuser: What is 0 + 1?\nassistant:"
    assert list(ds[0].token_ids) == tok.encode(ds[0].text)


def test_tokenizer_chat_template(tmp_path):
    from grpo_mega.data.tokenizer import HFTokenizer, train_bpe_tokenizer

    d = train_bpe_tokenizer(["hello world"] * 5, tmp_path / "bpe", vocab_size=300,
                            chat_template="{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
                                          "{% endfor %}{% if add_generation_prompt %}<a>{% endif %}")
    text = render_prompt([{"role": "user", "content": "hi"}], "tokenizer", HFTokenizer(d))
    assert text == "<user>hi<a>"


def test_chat_messages_without_template_is_an_error(tmp_path, tok):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": [{"role": "user", "content": "hi"}], "answer": "1"}])
    with pytest.raises(DataError, match=r"chat.jsonl:1: prompt is a list of chat messages; set a chat_template"):
        PromptDataset(path, tok)
    ds = PromptDataset(path, tok, chat_template="Q: {prompt} A:")
    assert ds[0].text == "Q: hi A:"


def test_order_is_a_function_of_seed_and_epoch(jsonl, tok):
    """Every rank builds its own dataset; they must agree without talking."""
    a, b, c = make(jsonl, tok, seed=7), make(jsonl, tok, seed=7), make(jsonl, tok, seed=8)
    epoch_a = [p.uid for p in a.next_batch(23)]
    assert epoch_a == [p.uid for p in b.next_batch(23)]
    assert epoch_a != [p.uid for p in c.next_batch(23)]
    assert sorted(epoch_a) == sorted(p.uid for p in a.prompts)  # each prompt once per epoch
    assert [p.uid for p in a.next_batch(23)] != epoch_a  # a new permutation in epoch 1
    assert a.epoch == 2 and a.offset == 0


def test_resume_sees_exactly_the_prompts_of_an_uninterrupted_run(jsonl, tok):
    """Batches of 5 over 23 prompts cross epoch boundaries mid-batch; the
    position must survive a save/load there too."""
    full = make(jsonl, tok, seed=3)
    uninterrupted = [[p.uid for p in full.next_batch(5)] for _ in range(12)]
    first = make(jsonl, tok, seed=3)
    for _ in range(7):
        first.next_batch(5)
    state = json.loads(json.dumps(first.state_dict()))  # must survive a JSON checkpoint
    resumed = make(jsonl, tok, seed=3)
    resumed.load_state_dict(state)
    assert [[p.uid for p in resumed.next_batch(5)] for _ in range(5)] == uninterrupted[7:]


def test_resume_refuses_different_data_or_seed(jsonl, tok, tmp_path):
    state = make(jsonl, tok, seed=3).state_dict()
    with pytest.raises(DataError, match="saved seed=3 but this dataset has seed=4"):
        make(jsonl, tok, seed=4).load_state_dict(state)
    other = write_jsonl(tmp_path / "other.jsonl", ROWS[:-1])
    with pytest.raises(DataError, match="num_prompts"):
        make(other, tok, seed=3).load_state_dict(state)


def test_malformed_jsonl_line_reports_file_and_line(tmp_path, tok):
    path = write_jsonl(tmp_path / "bad.jsonl", ROWS[:2], extra_lines=['{"question": "x", "answer": \n'])
    with pytest.raises(DataError, match=r"bad\.jsonl:3: malformed JSON"):
        make(path, tok)
    path = write_jsonl(tmp_path / "list.jsonl", ROWS[:1], extra_lines=["[1, 2]\n"])
    with pytest.raises(DataError, match=r"list\.jsonl:2: expected a JSON object per line, got list"):
        make(path, tok)


def test_missing_field_is_named(jsonl, tok, tmp_path):
    with pytest.raises(DataError, match=r"train\.jsonl:1: missing field 'prompt' .*set data prompt_field"):
        PromptDataset(jsonl, tok)
    with pytest.raises(DataError, match=r"missing field 'solution'.*reference_field"):
        make(jsonl, tok, reference_field="solution")
    with pytest.raises(DataError, match=r"missing field 'difficulty'"):
        make(jsonl, tok, metadata_fields=["difficulty"])
    nulls = write_jsonl(tmp_path / "null.jsonl", [{"question": None, "answer": "1"}])
    with pytest.raises(DataError, match=r"null\.jsonl:1: field 'question' is null"):
        make(nulls, tok)


def test_empty_or_missing_dataset_fails_before_anything_starts(tmp_path, tok):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match="is empty: no rows read"):
        make(empty, tok)
    with pytest.raises(DataError, match="does not exist"):
        make(tmp_path / "nope.jsonl", tok)
    with pytest.raises(DataError, match="unknown format '.csv'"):
        (tmp_path / "x.csv").write_text("a,b\n")
        make(tmp_path / "x.csv", tok)
    with pytest.raises(DataError, match="no data files"):
        make([], tok)


@pytest.mark.parametrize("n,dp", [(8, 2), (10, 4), (3, 3), (2, 4)])
def test_shard_for_replica_partitions_the_batch(n, dp):
    items = list(range(n))
    shards = [shard_for_replica(items, r, dp) for r in range(dp)]
    assert sum(shards, []) == items
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    with pytest.raises(ValueError):
        shard_for_replica(items, dp, dp)


# ---------------------------------------------------------------------------
# Chat-formatted rows: ``messages`` instead of a prompt
# ---------------------------------------------------------------------------

CHAT_ROWS = [
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "What is 2 + 3?"}], "answer": "5", "level": 1},
    {"question": "What is 1 + 1?", "answer": "2", "level": 0},
    {"messages": [{"role": "user", "content": "What is 4 + 4?"}], "answer": "8", "level": 2},
]


@pytest.fixture(scope="module")
def tiny_chat_tok(tmp_path_factory):
    from grpo_mega.data.tokenizer import HFTokenizer
    from grpo_mega.testing.tiny import build_tiny_tokenizer

    return HFTokenizer(build_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "qwen2", "qwen2"))


def test_messages_rows_render_with_the_tokenizers_chat_template(tmp_path, tiny_chat_tok):
    """Guards against chat rows rendered without the model's turn markers (or
    without the generation prompt), against a lost reference answer, and
    against the messages leaking into the metadata."""
    path = write_jsonl(tmp_path / "chat.jsonl", CHAT_ROWS)
    ds = make(path, tiny_chat_tok, shuffle=False, metadata_fields=["*"])
    first = ds[0]
    assert first.text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                          "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    assert first.text == tiny_chat_tok.hf.apply_chat_template(
        CHAT_ROWS[0]["messages"], tokenize=False, add_generation_prompt=True)
    assert list(first.token_ids) == tiny_chat_tok.encode(first.text)
    assert [p.reference for p in ds.prompts] == ["5", "2", "8"]
    assert dict(first.metadata) == {"level": 1}
    assert ds[1].text == "What is 1 + 1?"  # a plain-prompt row in the same file is unchanged
    assert ds[2].text.endswith("<|im_start|>user\nWhat is 4 + 4?<|im_end|>\n<|im_start|>assistant\n")


def test_messages_rows_follow_an_explicit_chat_template(tmp_path, tiny_chat_tok):
    """data.chat_template, when set, wins over the tokenizer's own template."""
    path = write_jsonl(tmp_path / "chat.jsonl", CHAT_ROWS[2:])
    ds = make(path, tiny_chat_tok, chat_template="Q: {prompt}\nA:")
    assert ds[0].text == "Q: What is 4 + 4?\nA:"


def test_messages_row_without_a_chat_template_names_the_row(tmp_path, tok):
    """Guards against a chat row silently rendered as raw text (or crashing
    deep inside transformers) when the tokenizer has no chat template: the
    error must name the file and row and say how to fix it."""
    path = write_jsonl(tmp_path / "chat.jsonl", CHAT_ROWS[1:])  # row 1 is plain, row 2 is chat
    with pytest.raises(DataError, match=r"chat.jsonl:2: row holds chat 'messages' but the tokenizer "
                                        r".* has no chat template.*data.chat_template"):
        make(path, tok)


def test_malformed_messages_rows_name_themselves(tmp_path, tiny_chat_tok):
    """Guards against a reply-included conversation used as a prompt, and
    against malformed messages reaching the template."""
    ends_with_reply = {"messages": [{"role": "user", "content": "hi"},
                                    {"role": "assistant", "content": "5"}], "answer": "5"}
    path = write_jsonl(tmp_path / "bad.jsonl", [CHAT_ROWS[2], ends_with_reply])
    with pytest.raises(DataError, match=r"bad.jsonl:2: field 'messages' ends with an assistant message"):
        make(path, tiny_chat_tok)
    path = write_jsonl(tmp_path / "bad2.jsonl", [{"messages": "hi", "answer": "1"}])
    with pytest.raises(DataError, match=r"bad2.jsonl:1: field 'messages' must be a non-empty list"):
        make(path, tiny_chat_tok)
    path = write_jsonl(tmp_path / "bad3.jsonl", [{"text": "hi", "answer": "1"}])
    with pytest.raises(DataError, match=r"bad3.jsonl:1: missing field 'question' and no chat "
                                        r"'messages' field either"):
        make(path, tiny_chat_tok)
