"""The trainer's side of gateway mode in one process (``trainer.gateway``): the pump, the
episode timeout, the dropped groups' metrics and the pause around a weight sync, against
the package's real vLLM engine and scripted model; no launch. A stand-in ``Trainer``
holds only what these functions read (one rank, one engine replica).

    OMP_NUM_THREADS=1 python -m pytest -q tests/unit/gateway/test_gateway_trainer.py
"""
from __future__ import annotations

import json
import math
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from grpo_mega.rollout.types import RolloutBatch, SamplingConfig
from tests.unit.gateway.harness import MAX_MODEL_LEN

SAMPLING = SamplingConfig(n=2, max_new_tokens=8, seed=7)
LATE_S = 6.0
"""The tests' episode timeout: room for the punctual episodes on a loaded machine (1-2 s
timed them out under a load average of 150)."""


def _trainer(engine, scripted, tmp_path, timeout: float = 2.0, error_reward=0.0):
    """A stand-in ``Trainer`` with a real gateway (``build_gateway``: HTTP on loopback, a key)."""
    from grpo_mega.config import Config
    from grpo_mega.data.tokenizer import HFTokenizer
    from grpo_mega.trainer.gateway import build_gateway

    cfg = Config()
    cfg.gateway.enabled, cfg.gateway.chat_format, cfg.gateway.api_key = True, "chatml", "k"
    cfg.gateway.episode_timeout_seconds, cfg.gateway.error_reward = timeout, error_reward
    cfg.rollout.max_model_len, cfg.logging.run_dir = MAX_MODEL_LEN, str(tmp_path)
    run = build_gateway(cfg, HFTokenizer(scripted[0]), 0, say=lambda *_: None)
    ps = SimpleNamespace(world_size=1, rank=0, dp=1, dp_rank=0, device=torch.device("cpu"))
    return SimpleNamespace(cfg=cfg, ps=ps, engine=engine, gateway=run, episodes=None)


def _prompts(k: int) -> list:
    from grpo_mega.data.prompts import Prompt

    return [Prompt(f"t:{i}", f"find {i}", (), str(i), {}, ({"role": "user", "content": f"find {i}"},))
            for i in range(k)]


def _post(url: str, body: dict, key: str = "k") -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _agent(url: str, plays, stop: threading.Event, log: list) -> None:
    """Takes tasks and plays each with ``plays(task, client)`` -> reward or None (never
    finishes it); calls and finishes are logged as (episode id, what, status)."""
    import openai

    while not stop.is_set():
        status, task = _post(f"{url}/tasks/next", {"wait": 0.2})
        if status == 410:
            return
        if task.get("episode_id") is None:
            continue
        client = openai.OpenAI(base_url=task["base_url"], api_key="k", max_retries=0)
        reward = plays(task, client, log)
        if reward is not None:
            log.append((task["episode_id"], "finish", _post(f"{url}/episodes/{task['episode_id']}/finish",
                                                           {"reward": reward})[0]))


def _call(task, client, log) -> int:
    import openai

    try:
        client.chat.completions.create(model="m", messages=task["messages"], max_tokens=4)
        status = 200
    except openai.APIStatusError as e:
        status = e.status_code
    log.append((task["episode_id"], "call", status))
    return status


def _with_agent(t, plays):
    stop, log = threading.Event(), []
    th = threading.Thread(target=_agent, args=(t.gateway.server.url, plays, stop, log), daemon=True)
    th.start()
    return stop, th, log


@pytest.mark.vllm
def test_gateway_episode_past_its_timeout_is_scored_error_reward_and_the_run_goes_on(engine, scripted, tmp_path):
    """Guards against finding 4 in gateway mode: an agent that never finishes one episode
    stopped the whole run at ``gateway.episode_timeout_seconds`` (a RuntimeError from the
    pump). It must end that episode only: its reward ``gateway.error_reward``, its error
    recorded (``episode_env_errors``), its call served before the deadline kept; a later
    call of it refused (409); the other episodes' rewards untouched. With
    ``error_reward=None`` the late episode's whole group is dropped (masks 0), the other
    group trained. Each episode's task is its own prompt's and each reward its own
    episode's (a task or reward shifted to a neighbour would train the wrong group)."""
    from grpo_mega.trainer.gateway import play_gateway

    def plays(task, client, log):
        log.append((task["episode_id"], "task", (task["prompt_index"], task["messages"][0]["content"])))
        status = _call(task, client, log)
        if task["prompt_index"] == 1 and task["episode_id"].endswith("e1"):  # hangs: never finishes
            release.wait(60)
            _call(task, client, log)  # after the deadline: the trainer ended it
            return None
        return 1.0 if status == 200 else None

    release = threading.Event()
    for error_reward in (0.0, None):
        release.clear()
        t = _trainer(engine, scripted, tmp_path, timeout=LATE_S, error_reward=error_reward)
        stop, th, log = _with_agent(t, plays)
        try:
            start = time.monotonic()
            batch = play_gateway(t, _prompts(2), step=1, sampling=SAMPLING)
            waited = time.monotonic() - start
            release.set()
            end = time.monotonic() + 20  # the late episode's second call, before the server closes
            while sum(w == "call" for _, w, _ in log) < 5 and time.monotonic() < end:
                time.sleep(0.05)
        finally:
            stop.set()
            t.gateway.close()
            th.join(10)
        late = [k for k, i in enumerate(batch.episode_info) if i["error"] is not None]
        assert late == [3], batch.episode_info
        assert LATE_S - 0.1 < waited < LATE_S + 30, waited
        assert "episode_timeout_seconds" in batch.episode_info[3]["error"]
        assert batch.episode_info[3]["env_error"] == 1 and batch.episode_info[3]["calls"] == 1
        assert batch.episode_rewards == [1.0, 1.0, 1.0, 0.0]
        assert all(map(any, batch.response_mask[:2]))
        dropped = [i["dropped"] for i in batch.episode_info]
        if error_reward is None:
            assert dropped == [0, 0, 1, 1] and not any(map(any, batch.response_mask[2:]))
        else:
            assert dropped == [0, 0, 0, 0] and any(batch.response_mask[3])
        tasks = sorted(x for e, what, x in log if what == "task")
        assert tasks == [(0, "find 0"), (0, "find 0"), (1, "find 1"), (1, "find 1")], tasks  # each its own prompt
        late_id = batch.episode_info[3]["episode_id"]
        assert [s for e, what, s in log if e == late_id and what == "call"][-1] in (404, 409), log


@pytest.mark.vllm
def test_gateway_episode_without_any_call_at_its_timeout_keeps_its_group_shape(engine, scripted, tmp_path):
    """Guards against a timed-out episode whose agent never called (a stuck agent) failing
    ``collect`` ("no chat call") and so stopping the run: its row is the task's prompt and
    one masked token, reward ``gateway.error_reward``, and the group keeps its n rows."""
    from grpo_mega.trainer.gateway import play_gateway

    def plays(task, client, log):
        if task["episode_id"].endswith("e1"):
            return None  # never calls, never finishes
        _call(task, client, log)
        return 1.0

    t = _trainer(engine, scripted, tmp_path, timeout=LATE_S)
    stop, th, _ = _with_agent(t, plays)
    try:
        batch = play_gateway(t, _prompts(1), step=1, sampling=SAMPLING)
    finally:
        stop.set()
        t.gateway.close()
        th.join(10)
    assert batch.prompt_index == [0, 0] and batch.episode_rewards == [1.0, 0.0]
    assert batch.response_mask[1] == [0] and batch.episode_info[1]["env_error"] == 1


def _stage_trainer(batch_info: list) -> SimpleNamespace:
    ps = SimpleNamespace(world_size=1, dp=1, device=torch.device("cpu"))
    return SimpleNamespace(ps=ps, episodes=None, gateway=object())


def test_gateway_reward_metrics_count_only_trained_groups():
    """Guards against dropped groups (an episode not token-exact, or ended with
    ``error_reward=None``) counting in the reward statistics: ``reward_mean``,
    ``reward_std``, ``accuracy``, ``response_len`` and ``truncated_frac`` are over the
    trained samples; the episode metrics (``episodes_dropped``) over every episode."""
    from grpo_mega.trainer.stages import reward

    # Two groups of 2: the first trained (rewards 1, 0), the second dropped (rewards 1, 1).
    info = [{"turns": 1, "dropped": d, "token_mismatch": d} for d in (0, 0, 1, 1)]
    batch = RolloutBatch(prompt_ids=[[1]] * 4, response_ids=[[2, 3], [2, 3, 4, 5], [2] * 6, [2] * 6],
                         logprobs=[[0.0] * n for n in (2, 4, 6, 6)], finish_reasons=["stop", "length", "length", "length"],
                         prompt_index=[0, 0, 1, 1], group_size=2, episode_rewards=[1.0, 0.0, 1.0, 1.0],
                         episode_info=info)
    _, stats = reward(_stage_trainer(info), [], batch)
    assert stats["reward_mean"] == 0.5 and stats["accuracy"] == 0.5 and stats["reward_std"] == 0.5, stats
    assert stats["response_len"] == 3.0 and stats["truncated_frac"] == 0.5, stats
    assert stats["episodes_dropped"] == 0.5 and stats["token_mismatch"] == 0.5, stats
    assert stats["episode_turns"] == 1.0, stats


def test_gateway_groups_with_an_inexact_episode_are_dropped():
    """Guards against a gateway episode that failed the token-exact check being trained
    (finding 2: only counted), or its group-mates being trained against it."""
    from grpo_mega.trainer.gateway import drop_groups

    info = [{"token_mismatch": 0, "error": None}, {"token_mismatch": 2, "error": None},
            {"token_mismatch": 0, "error": None}, {"token_mismatch": 0, "error": "late"}]
    batch = RolloutBatch(prompt_ids=[[1]] * 4, response_ids=[[2, 3]] * 4, logprobs=[[0.0, 0.0]] * 4,
                         finish_reasons=["stop"] * 4, prompt_index=[0, 0, 1, 1], group_size=2,
                         response_mask=[[1, 1]] * 4, episode_rewards=[1.0] * 4, episode_info=[dict(i) for i in info])
    drop_groups(batch, error_reward=0.0)
    assert [i["dropped"] for i in batch.episode_info] == [1, 1, 0, 0]
    assert batch.response_mask == [[0, 0], [0, 0], [1, 1], [1, 1]]
    batch.episode_info = [dict(i) for i in info]
    drop_groups(batch, error_reward=None)
    assert [i["dropped"] for i in batch.episode_info] == [1, 1, 1, 1]
    assert not math.isnan(sum(map(sum, batch.response_mask)))


class _Recorder:
    """The engine, with the time of each generate call (what a weight sync must not overlap)."""

    def __init__(self, engine):
        self._engine, self.times = engine, []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def generate(self, *args, **kw):
        self.times.append(time.monotonic())
        return self._engine.generate(*args, **kw)


@pytest.mark.vllm
def test_gateway_call_during_a_weight_sync_waits_and_is_served_by_the_new_weights(engine, scripted, tmp_path):
    """Guards against a gateway that serves an agent's call while the trainer loads new
    weights (between two rollouts: a reply from half-loaded layers, or from the old weights
    stamped as the new ones) or refuses it: the call waits in the queue, unanswered and not
    failed, while the weights load (the worker's reload open, then closed), and the next
    rollout's pump serves it with the new weights' log-probs."""
    from safetensors.torch import load_file

    import openai

    from grpo_mega.trainer.gateway import _pump

    t = _trainer(engine, scripted, tmp_path, timeout=120.0)  # also the call's request_timeout_s
    t.engine = _Recorder(engine)
    gw = t.gateway.gateway
    gw.set_sampling(SamplingConfig(n=1, max_new_tokens=8, seed=7))
    eid = gw.open_episode("sync0", prompt_index=0)
    url = t.gateway.server.url
    got: dict = {}

    def agent():
        client = openai.OpenAI(base_url=f"{url}/episodes/{eid}/v1", api_key="k", max_retries=0)
        try:
            got["reply"] = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                          max_tokens=1)
        except Exception as e:  # noqa: BLE001 - a refusal is what the test must not see
            got["error"] = e
        got["at"] = time.monotonic()
        _post(f"{url}/episodes/{eid}/finish", {"reward": 1.0})

    head = load_file(scripted[0] / "model.safetensors")["lm_head.weight"]
    th = threading.Thread(target=agent, daemon=True)
    try:
        th.start()
        end = time.monotonic() + 10
        while gw.batcher._queue.qsize() < 1 and time.monotonic() < end:  # the call is queued
            time.sleep(0.01)
        assert gw.batcher._queue.qsize() == 1, "the call never reached the gateway's queue"
        engine.update_weights({"lm_head.weight": head * 2})  # the sync: the reload is open ...
        time.sleep(0.5)
        assert not got and th.is_alive(), f"served or refused mid-sync: {got}"
        engine.reset_prefix_cache()  # ... and closed
        synced = time.monotonic()
        time.sleep(0.3)
        assert not got, "served outside a rollout"
        _pump(t, t.gateway, [eid], timeout=60)  # the next rollout
        th.join(30)
        assert "error" not in got and got["at"] > synced, got
        assert t.engine.times and min(t.engine.times) > synced, "the engine ran during the sync"
        batch = gw.collect([eid])
    finally:
        engine.update_weights({"lm_head.weight": head})
        engine.reset_prefix_cache()
        t.gateway.close()
    # The first sampled token's log-prob under the doubled head (the old head's differs).
    script = scripted[1]
    token, lp = batch.response_ids[0][0], batch.logprobs[0][0]
    new = float(torch.log_softmax(2 * script.logits[script.token_class(script.newline)], -1)[token])
    old = script.logprob(script.newline, token)
    assert abs(lp - new) < 1e-3 and abs(lp - old) > 0.1, (lp, new, old)
