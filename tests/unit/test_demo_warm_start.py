"""The demos' warm-start encoders: which tokens the one shared supervised loop
(``demo.assets.supervised_warm_start``) trains on.

Both demos warm start through the same loop and differ only in ``encode(tok, row) ->
(ids, loss_mask)``. The packaged tokenizers are used, so these tests are fast; the loop
itself runs only when a demo's assets are rebuilt.
"""
from __future__ import annotations

from pathlib import Path

import pytest

ASSETS = Path(__file__).resolve().parents[2] / "grpo_mega" / "assets"


@pytest.fixture(scope="module")
def toks():
    from grpo_mega.data.tokenizer import load_tokenizer

    return load_tokenizer(ASSETS / "demo_v1" / "tokenizer"), load_tokenizer(ASSETS / "demo_tools_v1" / "tokenizer")


def _split(ids, mask):
    return [t for t, m in zip(ids, mask, strict=True) if m], [t for t, m in zip(ids, mask, strict=True) if not m]


def test_demo_warm_start_addition_trains_on_the_answer_and_eos_only(toks):
    """Catches a loss mask that covers the prompt (the model would be taught to echo the
    question) or drops the eos (it would never learn to stop)."""
    from grpo_mega.demo.assets import answer_tokens

    tok = toks[0]
    ids, mask = answer_tokens(tok, {"prompt": "37+45=", "answer": "82"})
    trained, untrained = _split(ids, mask)
    assert ids == tok.encode("37+45=") + tok.encode("82") + [tok.eos_id]
    assert trained == tok.encode("82") + [tok.eos_id]
    assert untrained == tok.encode("37+45=")


def test_demo_warm_start_tool_episode_trains_on_the_models_turns_not_the_tools_result(toks):
    """Catches the tool's result (``1665=``) or the question being trained on, a model turn
    left out of the loss, or an eos missing after either model turn: the warm-started model
    would then write tool results itself, or never end its call."""
    from grpo_mega.demo.tools import episode_tokens

    tok = toks[1]
    ids, mask = episode_tokens(tok, {"prompt": "37*45=", "answer": "1665"})
    eos = tok.eos_id
    assert ids == tok.encode("37*45=") + tok.encode("[37*45]") + [eos] + tok.encode("1665=") \
        + tok.encode("1665") + [eos]
    trained, untrained = _split(ids, mask)
    assert trained == tok.encode("[37*45]") + [eos] + tok.encode("1665") + [eos]
    assert untrained == tok.encode("37*45=") + tok.encode("1665=")
