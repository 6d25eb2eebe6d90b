"""The gateway tests' shared parts: one scripted model and one vLLM engine for the package
(both test modules use them; an engine costs about 10 s to start), and the chat format
alone for the limits tests."""
from __future__ import annotations

import importlib.util

import pytest

from grpo_mega.rollout.types import SamplingConfig
from tests.unit.gateway.harness import MAX_MODEL_LEN
from tests.unit.gateway.scripted import build_scripted_model

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.fixture(scope="package")
def scripted(tmp_path_factory):
    """(model dir, ``Scripted``, the real ChatML ``ChatCodec`` on its tokenizer)."""
    from grpo_mega.data.tokenizer import HFTokenizer
    from grpo_mega.rollout.chat_codec import ChatCodec

    model, script = build_scripted_model(tmp_path_factory.mktemp("gateway"))
    return model, script, ChatCodec.for_tokenizer(HFTokenizer(model), "chatml")


@pytest.fixture(scope="package")
def chatml_codec(tmp_path_factory):
    """The real ChatML ``ChatCodec`` on the scripted tokenizer alone (no model, no engine:
    the limits tests need the chat format, not a model)."""
    from grpo_mega.data.tokenizer import HFTokenizer
    from grpo_mega.rollout.chat_codec import ChatCodec
    from tests.unit.gateway.scripted import build_scripted_tokenizer

    return ChatCodec.for_tokenizer(HFTokenizer(build_scripted_tokenizer(tmp_path_factory.mktemp("tok") / "tok")),
                                   "chatml")


@pytest.fixture(scope="package")
def engine(scripted):
    if not HAVE_VLLM:
        pytest.skip("vllm is not installed")
    from grpo_mega.rollout import EngineConfig, RolloutEngine

    eng = RolloutEngine(EngineConfig(str(scripted[0]), max_model_len=MAX_MODEL_LEN), SamplingConfig(n=1))
    yield eng
    eng.shutdown()
