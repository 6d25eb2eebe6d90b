"""Tool calls of a turn within the collective timeout (issue 38, finding 6).

The environments of a turn run on each engine replica's first rank while every other
rank waits in a collective with a 10-minute timeout; one after the other, about 128
sleeping tool calls timed the whole job out. Here the real ``python_tool`` environment
and sandbox answer real tool calls through ``rollout.multi_turn.run_episodes``; only the
engine and the chat format are stand-ins (a turn that always calls the tool), so no
model is needed.
"""
from __future__ import annotations

import re
import threading
import time

import pytest

from grpo_mega.config import Config
from grpo_mega.envs import PythonToolEnv, ToolEnv
from grpo_mega.rollout.multi_turn import EpisodeLimits, run_episodes
from grpo_mega.rollout.types import RolloutBatch, SamplingConfig
from grpo_mega.preflight.env_budget import turn_budget_seconds
from grpo_mega.trainer.episodes import check_env_budget
from tests.unit.envs.sandbox_probe import needs_sandbox


class ToolCallingCodec:
    """Every sampled turn parses as one ``python`` call running ``code``."""

    eot_id = 0

    def __init__(self, code: str):
        self.code = code

    def first_ids(self, messages, tools):
        return [1, 2, 3]

    def delta_ids(self, history, new, tools):
        return [4]

    def parse(self, ids):
        if self.code is None:  # a final answer
            return {"role": "assistant", "content": "The answer is 1."}
        return {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c0", "type": "function", "function": {"name": "python", "arguments": {"code": self.code}}}]}

    def check(self, *args):
        return []


def generate(prompts, sampling, *, step, keys, budgets):
    n = len(prompts)
    return RolloutBatch(prompt_ids=[list(p) for p in prompts], response_ids=[[7]] * n, logprobs=[[-0.5]] * n,
                        finish_reasons=["stop"] * n, prompt_index=list(range(n)), group_size=1)


def play(episodes: int, code, make_env=PythonToolEnv, **limits):
    rows = [{"prompt": f"q{i}", "answer": "1"} for i in range(episodes)]
    return run_episodes(generate, ToolCallingCodec(code), make_env, rows, SamplingConfig(n=1),
                        EpisodeLimits(max_turns=2, **limits), step=0)


@needs_sandbox
def test_tool_calls_of_a_turn_run_in_parallel_within_the_budget():
    """Finding 6: tool calls ran one after the other, so N sleeping calls took N times as
    long as one, and the waiting ranks' collective timed out. 8 episodes each sleeping
    0.6 s in the sandbox must finish within a 3 s budget with 8 workers (one after the
    other they take 4.8 s), and every call must have run."""
    start = time.monotonic()
    batch = play(8, "import time; time.sleep(0.6); print('slept')", env_workers=8, env_budget_seconds=3.0)
    assert 0.6 <= time.monotonic() - start < 3.0
    # two turns each: the first call answered (no error), the second ends the episode
    assert [(i["tool_calls"], i["tool_errors"], i["turns"]) for i in batch.episode_info] == [(2, 0, 2)] * 8


@needs_sandbox
def test_multi_turn_tool_calls_past_the_budget_end_their_episodes_at_the_budget_naming_the_flags():
    """Finding 6, the bound (issue 40 finding 4: per episode, not the run): past the turn's
    budget the unfinished steps must end their own episodes at once, with an error naming
    the flags to change, not wait for every call (nor for the collective timeout), and not
    raise out of the rollout."""
    start = time.monotonic()
    batch = play(4, "import time; time.sleep(2)", env_workers=1, env_budget_seconds=0.5)
    assert time.monotonic() - start < 1.5
    errors = [i["error"] for i in batch.episode_info]
    assert sum(e is not None for e in errors) >= 3, errors  # one worker: at most one step finished
    assert all(re.search(r"env\.turn_budget_seconds=0\.5.*--env\.tool_workers", e) for e in errors if e)
    assert [r for r, e in zip(batch.episode_rewards, errors) if e] == [0.0] * sum(e is not None for e in errors)


class ThreadRecordingEnv(ToolEnv):
    """The base tool environment (math reward), noting the thread each score runs on."""

    threads: list = []

    def score(self, final: str) -> float:
        self.threads.append(threading.current_thread() is threading.main_thread())
        return super().score(final)


def test_final_answers_are_scored_on_the_calling_thread():
    """Finding 6, the rewards: scoring a final answer in a worker thread would lose
    math-verify's timeout (``signal.alarm`` works on the main thread only), so a
    pathological answer could hold the turn. Steps without tool calls stay on the calling
    thread; only tool calls go to the workers."""
    ThreadRecordingEnv.threads = []
    batch = play(4, None, make_env=ThreadRecordingEnv, env_workers=4, env_budget_seconds=30.0)
    assert ThreadRecordingEnv.threads == [True] * 4
    assert batch.episode_rewards == [1.0] * 4


def test_turn_budget_must_stay_below_the_collective_timeout():
    """Finding 6, the config: a budget at or past the collective timeout would let the
    waiting ranks time out first, with no word of the tools; a worker count below 1 would
    run nothing. Both are refused, naming the flags."""
    cfg = Config()
    check_env_budget(cfg)  # the defaults fit
    cfg.parallel.timeout_minutes = 5
    check_env_budget(cfg)  # the default follows the timeout: 80% of it (the demos' 5 minutes)
    assert turn_budget_seconds(cfg) == 240.0
    cfg.env.turn_budget_seconds = 300.0
    with pytest.raises(ValueError, match=r"env\.turn_budget_seconds=300\.0.*--parallel\.timeout_minutes"):
        check_env_budget(cfg)
    cfg.env.turn_budget_seconds, cfg.env.tool_workers = 60.0, 0
    with pytest.raises(ValueError, match=r"--env\.tool_workers"):
        check_env_budget(cfg)


def test_start_up_refuses_a_turn_budget_past_the_collective_timeout_once():
    """Finding 6, at start-up: the budget was checked only when the episodes were built, on
    every rank after the process groups existed (one traceback per rank). ``validate`` (so
    the launcher's pre-check too) refuses it first, as a ConfigError naming the flags."""
    from grpo_mega.config import ConfigError, load_config
    from grpo_mega.preflight.validate import validate

    cfg = load_config(None, ["--env.name=python_tool", "--parallel.timeout_minutes=5",
                             "--env.turn_budget_seconds=300"])
    with pytest.raises(ConfigError, match=r"--env\.turn_budget_seconds"):
        validate(cfg, 1, check_hardware=False)
