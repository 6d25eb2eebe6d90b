"""The trainer owns sampling through the gateway (issue 40 finding 1): temperature, top-p,
top-k, seeds and token budgets come from the gateway's ``SamplingConfig`` and
``GatewayConfig``, never from the agent's request; ``collect`` refuses episodes sampled
under other settings. The real ``openai`` client against the real server, the package's
real vLLM engine behind it (``conftest.py``).

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/gateway/test_gateway_sampling.py
"""
from __future__ import annotations

import dataclasses
import importlib.util

import pytest

from tests.unit.gateway.harness import make_gateway, to_dicts

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("openai") is None, reason="the openai client is not installed")]

ASK = [{"role": "user", "content": "hi"}]


def _client(server, episode):
    import openai

    return openai.OpenAI(base_url=server.base_url(episode), api_key="unused", max_retries=0)


def test_gateway_refuses_sampling_the_agent_asks_for(engine, scripted):
    """Guards against an agent deciding the sampling of training episodes: under the default
    policy (``refuse``) a request's temperature, top-p or seed other than the trainer's is a
    400 naming the field, the configured value and the policy flag, and reaches no engine;
    the trainer's own values are accepted, and ``max_tokens`` far above the budget is
    clipped to the per-reply ``max_new_tokens`` (not passed to the engine as 100000)."""
    import openai

    gw, spy = make_gateway(engine, scripted)
    assert gw.config.sampling_policy == "refuse"
    with gw.serve() as server:
        client = _client(server, "e")
        for field, value, configured in (("temperature", 0.0, "1.0"), ("top_p", 0.5, "1.0"), ("seed", 5, None)):
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model="m", messages=ASK, **{field: value})
            err = e.value.body
            assert err["param"] == field and err["code"] == "sampling_not_allowed", err
            assert "gateway.sampling_policy=override" in err["message"], err
            assert configured is None or f"{field}={configured}" in err["message"], err
        assert not spy.calls, "a refused request reached the engine"
        r = client.chat.completions.create(model="m", messages=ASK, temperature=1.0, top_p=1.0, max_tokens=100000)
    assert r.usage.completion_tokens <= gw.sampling.max_new_tokens
    assert [kw["budgets"] for _, kw in spy.asked] == [[gw.sampling.max_new_tokens]], \
        "max_tokens=100000 reached the engine unclipped"


def test_gateway_seeds_are_per_episode_and_the_policy_overrides(engine, scripted):
    """Guards against the agent's seed reaching the engine: a group of four episodes whose
    agent sends ``seed=1`` and ``temperature=0`` each would sample four identical replies
    (zero advantage). Under ``sampling_policy=override`` they are served at the trainer's
    sampling, each episode with its own seed key, and counted as overridden; a second round
    opened with the same keys, step and seed draws the same replies (reproducible from the
    run's seed), one with another seed others."""
    def round_(seed):
        gw, spy = make_gateway(engine, scripted, sampling_policy="override")
        gw.set_sampling(dataclasses.replace(gw.sampling, seed=seed))
        gw.step = 3
        with gw.serve() as server:
            ids = [gw.open_episode(prompt_index=0, key=k) for k in range(4)]
            for i in ids:
                _client(server, i).chat.completions.create(model="m", messages=ASK, seed=1, temperature=0.0)
            batch = gw.collect(ids, group_size=4, default_reward=0.0)
        return batch, spy

    batch, spy = round_(7)
    keys = [k for _, kw in spy.asked for k in kw["keys"]]
    assert len(set(keys)) == 4, f"the episodes of a group share seed keys {keys}"
    assert all(s.temperature == 1.0 and s.seed == 7 for s, _ in spy.asked), "the request's sampling was used"
    assert [i["sampling_overridden"] for i in batch.episode_info] == [1] * 4
    assert all(i["sampling"] == [[1.0, 1.0, 0]] for i in batch.episode_info)
    assert len({tuple(r) for r in batch.response_ids}) > 1, "four episodes of a group drew the same reply"
    again, _ = round_(7)
    assert again.response_ids == batch.response_ids, "the same keys, step and seed drew other replies"
    other, _ = round_(8)
    assert other.response_ids != batch.response_ids, "another seed drew the same replies"


def test_gateway_episode_budget_and_mixed_sampling_are_refused(engine, scripted):
    """Guards against an episode outgrowing its token budget (``max_episode_tokens``: each
    call clipped to what is left, a call with nothing left a 400) and against ``collect``
    mixing distributions in a group: an episode served at temperature 1 collected after the
    trainer switched the gateway to greedy is refused."""
    import openai

    _, _, codec = scripted
    gw, spy = make_gateway(engine, scripted)
    with gw.serve() as server:
        client = _client(server, "b")
        first = client.chat.completions.create(model="m", messages=ASK)
        assert first.choices[0].finish_reason != "length", "the first reply was cut; the test proves less"
        convo = ASK + [first.choices[0].message, {"role": "user", "content": "more"}]
        used = first.usage.completion_tokens + len(codec.delta_ids(to_dicts(convo[:2]), to_dicts(convo[2:]), []))
        gw.config = dataclasses.replace(gw.config, max_episode_tokens=used)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="m", messages=convo)
        assert e.value.body["code"] == "episode_budget_exhausted" and "max_episode_tokens" in e.value.body["message"]
        gw.config = dataclasses.replace(gw.config, max_episode_tokens=used + 2)
        client.chat.completions.create(model="m", messages=convo, max_tokens=1000)
        assert spy.asked[-1][1]["budgets"] == [2], "the call was not clipped to the episode's remaining budget"
        assert gw.episode("b").summary()["env_tokens"] + gw.episode("b").summary()["model_tokens"] <= used + 2
        gw.discard("b")

        a = gw.open_episode(prompt_index=0)
        _client(server, a).chat.completions.create(model="m", messages=ASK)
        gw.set_sampling(dataclasses.replace(gw.sampling, temperature=0.0))
        b = gw.open_episode(prompt_index=0)
        _client(server, b).chat.completions.create(model="m", messages=ASK)
        with pytest.raises(ValueError, match="not the trainer's"):
            gw.collect([a, b], group_size=2, default_reward=0.0)
        assert gw.collect([b], default_reward=0.0).episode_info[0]["sampling"] == [[0.0, 1.0, 0]]
