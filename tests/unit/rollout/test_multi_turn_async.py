"""The asynchronous episode driver (issue 40 deliverable 4) against the lockstep one.

A stand-in engine that decodes one token per request per step (continuous batching: requests
join and leave between steps), its tokens a pure function of the request's seed key, so the
lockstep driver (whole-batch ``generate``) and the asynchronous one (``TurnEngine``) get the
very same turns and must build the very same batch. The environments are real Python
objects whose tool calls sleep.
"""
from __future__ import annotations

import threading
import time

import pytest

from grpo_mega.envs.types import StepResult
from grpo_mega.rollout.multi_turn import EpisodeLimits, run_episodes
from grpo_mega.rollout.multi_turn_async import run_episodes_async
from grpo_mega.rollout.types import RolloutBatch, SamplingConfig

EOT = 0


def _turn(step: int, key: int, budget: int) -> list[int]:
    """The tokens the engine samples for (seed step, key): 1-4 tokens, then the end of turn."""
    n = 1 + (step * 7 + key * 3) % 4
    out = [10 + (step + key + t) % 20 for t in range(n)] + [EOT]
    return out[:budget]


class StepEngine:
    """``TurnEngine``: every step emits one token of every request in flight."""

    logprobs_mode = "raw_logprobs"

    def __init__(self, step_s: float = 0.0):
        self.live, self.step_s, self.steps = {}, step_s, 0

    def add(self, key, ids, sampling, *, step, budget):
        self.live[key] = (_turn(step, key, budget), 0, budget)

    @property
    def busy(self):
        return bool(self.live)

    def step(self):
        time.sleep(self.step_s)
        self.steps += 1
        done = []
        for key, (toks, k, budget) in list(self.live.items()):
            k += 1
            if k == len(toks):
                del self.live[key]
                done.append((key, toks, [-0.5] * len(toks), "stop" if toks[-1] == EOT else "length"))
            else:
                self.live[key] = (toks, k, budget)
        return done


def generate(prompts, sampling, *, step, keys, budgets):
    """The lockstep driver's whole-batch ``generate`` over the same turns."""
    outs = [_turn(step, k, b) for k, b in zip(keys, budgets)]
    n = len(prompts)
    return RolloutBatch(prompt_ids=[list(p) for p in prompts], response_ids=outs,
                        logprobs=[[-0.5] * len(o) for o in outs],
                        finish_reasons=["stop" if o[-1] == EOT else "length" for o in outs],
                        prompt_index=list(range(n)), group_size=1)


class Codec:
    """A turn whose first token is even calls the tool, else it answers."""

    eot_id = EOT

    def first_ids(self, messages, tools):
        return [1, 2, 3]

    def delta_ids(self, history, new, tools):
        return [4, 5]

    def parse(self, ids):
        if ids[0] % 2 == 0:
            return {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "t", "arguments": {}}}]}
        return {"role": "assistant", "content": "done"}

    def check(self, *args):
        return []


class CallingCodec(Codec):
    """Every turn calls the tool (the environment ends the episode)."""

    def parse(self, ids):
        return super().parse([0])


class SleepyEnv:
    """Tool calls sleep ``SLOW_S`` for prompt ``slow``, ``FAST_S`` otherwise; the third call
    ends the episode; an answer scores 1."""

    tools: list = []
    SLOW_S, FAST_S = 0.6, 0.01
    log: list = []
    lock = threading.Lock()

    def reset(self, row):
        self.row, self.calls = row["prompt"], 0
        return [{"role": "user", "content": self.row}]

    def step(self, message):
        if message.get("tool_calls"):
            time.sleep(self.SLOW_S if self.row == "slow" else self.FAST_S)
            self.calls += 1
            with self.lock:
                self.log.append((self.row, time.monotonic()))
            return StepResult([{"role": "tool", "content": "r"}], reward=0.25, done=self.calls >= 3)
        return StepResult([], reward=1.0, done=True)

    def close(self):
        pass


ROWS = [{"prompt": p} for p in ("slow", "a", "b", "c")]


def _limits(**kw):
    return EpisodeLimits(**{"max_turns": 4, "max_tokens": 40, "max_model_len": 64, "env_workers": 4, **kw})


def test_multi_turn_async_builds_the_lockstep_batch():
    """Deliverable 4, exactness unchanged: the asynchronous driver must ask the engine for the
    same turns (seed keys per episode and turn, budgets) and build the very batch the lockstep
    driver builds: ids, masks, log-probs, rewards, finishes, group-major order."""
    s = SamplingConfig(n=2, max_new_tokens=3)
    want = run_episodes(generate, Codec(), SleepyEnv, ROWS, s, _limits(), step=3)
    got = run_episodes_async(StepEngine(), Codec(), SleepyEnv, ROWS, s, _limits(), step=3)
    for field in ("prompt_ids", "response_ids", "response_mask", "logprobs", "finish_reasons", "prompt_index",
                  "episode_rewards"):
        assert getattr(got, field) == getattr(want, field), field
    assert [i["turns"] for i in got.episode_info] == [i["turns"] for i in want.episode_info]
    assert max(i["turns"] for i in got.episode_info) >= 2 and "length" in got.finish_reasons  # budgets cut turns


def test_multi_turn_async_episodes_do_not_wait_for_another_episodes_tool_call():
    """Deliverable 4: in lockstep, every episode waited each turn for the slowest tool call
    of any episode. Here the fast episodes must finish all their turns while the slow
    episode's first tool call is still out, and the whole run must take about one slow call,
    not one per turn."""
    SleepyEnv.log = []
    s = SamplingConfig(n=1, max_new_tokens=8)
    start = time.monotonic()
    batch = run_episodes_async(StepEngine(0.002), CallingCodec(), SleepyEnv, ROWS, s, _limits(), step=0)
    took = time.monotonic() - start
    slow_first = min(t for row, t in SleepyEnv.log if row == "slow")
    fast_last = max(t for row, t in SleepyEnv.log if row != "slow")
    assert fast_last < slow_first, "a fast episode waited for the slow tool call"
    slow_calls = sum(row == "slow" for row, _ in SleepyEnv.log)
    assert slow_calls == 3 and took < 3 * SleepyEnv.SLOW_S + 0.3  # lockstep: the same, plus every fast turn
    assert len(batch) == 4 and [i["tool_calls"] for i in batch.episode_info] == [3] * 4


def test_multi_turn_async_tool_calls_are_bounded_and_isolated():
    """Deliverable 4 with finding 4: tool calls at once stay within ``env_workers`` and a hung
    tool call ends only its own episode at ``step_timeout_seconds``."""
    SleepyEnv.log = []
    active, peak, lock = [0], [0], threading.Lock()

    class Counting(SleepyEnv):
        def step(self, message):
            if not message.get("tool_calls"):  # final answers are scored on the calling thread
                return super().step(message)
            with lock:
                active[0] += 1
                peak[0] = max(peak[0], active[0])
            try:
                return super().step(message)
            finally:
                with lock:
                    active[0] -= 1

    rows = [{"prompt": p} for p in ("slow", "a", "b", "c", "d", "e")]
    s = SamplingConfig(n=2, max_new_tokens=8)
    batch = run_episodes_async(StepEngine(), CallingCodec(), Counting, rows, s,
                               _limits(env_workers=2, step_timeout_seconds=0.3), step=1)
    assert peak[0] <= 2
    errors = [i["error"] for i in batch.episode_info]
    assert all(e and "env.step_timeout_seconds=0.3" in e for e in errors[:2])
    assert all(e is None for e in errors[2:])


def test_multi_turn_async_scheduling_is_refused_where_the_engine_cannot_step_alone():
    """Deliverable 4, the config: the asynchronous driver steps an in-process engine alone;
    a job of several processes (whose engine replicas call vLLM together) or a child engine
    must be refused at start-up naming the flag, not fail mid-rollout."""
    from grpo_mega.config import ConfigError, load_config
    from grpo_mega.preflight.validate import validate

    flags = ["--env.name=calculator", "--env.scheduling=async"]
    validate(load_config(None, flags), 1, check_hardware=False)
    with pytest.raises(ConfigError, match=r"--env\.scheduling=lockstep"):
        validate(load_config(None, flags), 2, check_hardware=False)
    with pytest.raises(ConfigError, match=r"--env\.scheduling=lockstep"):
        validate(load_config(None, flags + ["--rollout.engine_mode=child"]), 1, check_hardware=False)
