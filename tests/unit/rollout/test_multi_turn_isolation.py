"""Episodes isolated from each other, and clean turn boundaries (issue 40 findings 2 and 4).

The driver (``rollout.multi_turn.run_episodes``) against stand-in engine and chat format:
every turn samples one token and parses as a tool call, so each episode steps its
environment every turn; the environments are real Python objects that raise, hang or
answer. No model is needed: what is tested is the driver's bookkeeping.
"""
from __future__ import annotations

import threading
import time

import pytest

from grpo_mega.envs.types import StepResult
from grpo_mega.rollout.multi_turn import EpisodeLimits, run_episodes
from grpo_mega.rollout.types import RolloutBatch, SamplingConfig
from grpo_mega.trainer.episodes import EPISODE_KEYS, episode_stats


class CallingCodec:
    """Every turn parses as one tool call; ``check`` reports a problem for the episodes
    whose first user message is in ``inexact``."""

    eot_id = 0

    def __init__(self, inexact=()):
        self.inexact = set(inexact)

    def first_ids(self, messages, tools):
        return [1, 2, 3]

    def delta_ids(self, history, new, tools):
        return [4]

    def parse(self, ids):
        return {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c0", "type": "function", "function": {"name": "t", "arguments": {}}}]}

    def check(self, prompt_ids, segments, messages, *args):
        return ["segment 2 differs"] if messages[0]["content"] in self.inexact else []


def generate(prompts, sampling, *, step, keys, budgets):
    n = len(prompts)
    return RolloutBatch(prompt_ids=[list(p) for p in prompts], response_ids=[[7, 0]] * n,
                        logprobs=[[-0.5, -0.1]] * n, finish_reasons=["stop"] * n, prompt_index=list(range(n)),
                        group_size=1)


class ScriptedEnv:
    """Per prompt: ``ok`` answers (reward 0.5 a turn, done at turn 2), ``raise`` raises in
    ``step``, ``hang`` sleeps ``HANG_S`` in ``step``."""

    tools: list = []
    HANG_S = 3.0
    release = threading.Event()

    def reset(self, row):
        self.kind, self.turn = row["prompt"].split("-")[0], 0
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, message):
        self.turn += 1
        if self.kind == "raise":
            raise ZeroDivisionError("the user's environment divided by zero")
        if self.kind == "hang":
            self.release.wait(self.HANG_S)
        return StepResult([{"role": "tool", "content": "ok"}], reward=0.5, done=self.turn >= 2)

    def close(self):
        pass


def play(prompts, codec=None, g=2, **limits):
    rows = [{"prompt": p} for p in prompts]
    limits = {"max_turns": 3, "env_workers": 8, **limits}
    return run_episodes(generate, codec or CallingCodec(), ScriptedEnv, rows, SamplingConfig(n=g),
                        EpisodeLimits(**limits), step=0)


def test_multi_turn_env_that_raises_ends_only_its_own_episode():
    """Finding 4: one exception in a user environment's ``step`` ended the whole run. It
    must end only its own episodes (finish ``error``, the error recorded, reward
    ``error_reward``), the others running on to their environment's end, and the metric
    ``episode_env_errors`` counts them."""
    batch = play(["ok-0", "raise-1", "ok-2"])
    assert batch.finish_reasons == ["stop", "stop", "error", "error", "stop", "stop"]
    assert batch.episode_rewards == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    errors = [i["error"] for i in batch.episode_info]
    assert errors[2] and "ZeroDivisionError" in errors[2] and errors[0] is None
    stats = dict(zip(EPISODE_KEYS, episode_stats(batch)))
    assert stats["episode_env_errors"] == 2 and stats["episodes_dropped"] == 0
    assert all(any(m) for m in batch.response_mask)  # errors are trained with their reward


def test_multi_turn_env_error_reward_is_configurable_and_null_drops_the_group():
    """Finding 4, the policy: ``env.error_reward`` sets the reward of an errored episode; null
    drops its whole group from training (every mask 0), the other groups untouched."""
    batch = play(["ok-0", "raise-1"], error_reward=-1.0)
    assert batch.episode_rewards == [1.0, 1.0, -1.0, -1.0]
    batch = play(["ok-0", "raise-1"], error_reward=None)
    assert [any(m) for m in batch.response_mask] == [True, True, False, False]
    assert [i["dropped"] for i in batch.episode_info] == [0, 0, 1, 1]


def test_multi_turn_env_that_hangs_ends_its_episode_at_the_step_timeout():
    """Finding 4, a hang: a ``step`` that never returns held the turn (and the waiting
    ranks) until the collective timed out. Past ``env.step_timeout_seconds`` it must end
    its own episode with an error naming the flag, while the other episodes finish."""
    ScriptedEnv.release.clear()
    start = time.monotonic()
    try:
        batch = play(["hang-0", "ok-1"], step_timeout_seconds=0.3, env_budget_seconds=30.0)
    finally:
        ScriptedEnv.release.set()  # let the abandoned threads return
    assert time.monotonic() - start < 2.0
    assert batch.finish_reasons == ["error", "error", "stop", "stop"]
    assert all("env.step_timeout_seconds=0.3" in batch.episode_info[k]["error"] for k in (0, 1))
    assert batch.episode_rewards == [0.0, 0.0, 1.0, 1.0]


def test_multi_turn_inexact_episode_drops_its_whole_group_from_training():
    """Finding 2: an episode that failed the token-exact check was trained with its reward
    (``token_mismatch`` only logged). Its group must be dropped from training (every
    response token's mask 0, so the loss and its normalisers skip it: the others'
    advantages are relative to it), the other groups kept whole, and the metric
    ``episodes_dropped`` must count the group's episodes."""
    batch = play(["ok-0", "ok-1", "ok-2"], codec=CallingCodec(inexact={"ok-1"}))
    assert [any(m) for m in batch.response_mask] == [True, True, False, False, True, True]
    assert [len(m) for m in batch.response_mask] == [len(r) for r in batch.response_ids]
    stats = dict(zip(EPISODE_KEYS, episode_stats(batch)))
    assert stats["episodes_dropped"] == 2 and stats["token_mismatch"] == 2


def test_multi_turn_stop_strings_are_refused_with_an_environment():
    """Finding 2: a turn cut at a ``rollout.stop`` string has no end-of-turn token, yet the
    environment's reply was appended straight after it, and start-up accepted
    ``rollout.stop`` with ``env.name``. Both the driver and start-up must refuse it, naming
    the flag."""
    from grpo_mega.config import ConfigError, load_config
    from grpo_mega.preflight.validate import validate

    rows = [{"prompt": "ok-0"}]
    with pytest.raises(ValueError, match=r"--rollout\.stop=\[\]"):
        run_episodes(generate, CallingCodec(), ScriptedEnv, rows, SamplingConfig(n=1, stop=("</answer>",)),
                     EpisodeLimits(max_turns=2), step=0)
    cfg = load_config(None, ["--env.name=calculator", "--rollout.stop=[\"</answer>\"]"])
    with pytest.raises(ConfigError, match=r"rollout\.stop.*--rollout\.stop=\[\]"):
        validate(cfg, 1, check_hardware=False)
