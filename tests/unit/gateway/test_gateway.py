"""The OpenAI-compatible gateway records what the engine consumed and produced, exactly:
the real ``openai`` client against the real server on loopback, in front of a real vLLM
engine on CPU.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/gateway

One engine for the package (``conftest.py``), serving a scripted tiny Qwen2
(``scripted.py``: its next-token log-probs are known exactly; it writes tool calls, and
replies whose bytes do not survive decode + encode) with the real ChatML chat format
(``rollout.chat_codec``). Each test starts its own gateway and server (milliseconds).
Refusals and failures: ``test_gateway_errors.py``. Resource bounds (no engine: deadlines,
caps, the key before the body, malformed JSON, a load test): ``test_gateway_limits.py``.
"""
from __future__ import annotations

import importlib.util
import json
import re
import threading

import pytest

from tests.unit.gateway.harness import (GOOD, expected_trajectory, make_gateway, post, raw, run_agent,
                                        to_dicts)
from tests.unit.gateway.scripted import TOOLS

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("openai") is None, reason="the openai client is not installed")]


def test_gateway_agent_loop_records_the_engines_ids_exactly(engine, scripted):
    """Guards against a re-tokenized history, a dropped or doubled delta, and a mask or
    log-prob shifted against the model's tokens: four unmodified openai-client agents (two
    groups of two, side by side, tool calls included) must leave, per episode, exactly the
    first prompt's ids + the engine's sampled ids + the chat format's delta ids of what the
    agent added; mask 1 exactly on the sampled ids, each with the engine's log-prob, which is
    the scripted model's true log-prob of that token after the one before it."""
    _, script, codec = scripted
    gw, spy = make_gateway(engine, scripted, batch_wait_s=0.2)
    with gw.serve() as server:
        ids = [gw.open_episode(prompt_index=i // 2) for i in range(4)]
        results: dict[int, tuple] = {}
        start = threading.Barrier(4)

        def play(k):
            start.wait()
            reward, messages = run_agent(server.base_url(ids[k]), f"task {k}", as_dicts=k % 2 == 1)
            post(f"{server.url}/episodes/{ids[k]}/reward", {"reward": reward})
            post(f"{server.url}/episodes/{ids[k]}/finish", {})
            results[k] = (reward, messages)

        threads = [threading.Thread(target=play, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(results) == [0, 1, 2, 3], "an agent failed (see the log)"
        assert gw.wait(ids, timeout=5)
        batch = gw.collect(ids, group_size=2)

    assert batch.prompt_index == [0, 0, 1, 1] and batch.group_size == 2 and len(batch) == 4
    assert max(len(p) for p, _ in spy.calls) > 1, "side-by-side agents never shared an engine call"
    all_sampled = []
    for k in range(4):
        reward, messages = results[k]
        prompt, response, lps, (mask, sampled) = expected_trajectory(codec, spy, messages)
        assert batch.prompt_ids[k] == prompt
        assert batch.response_ids[k] == response, f"episode {k}: recorded ids are not the engine's"
        assert batch.response_mask[k] == mask, f"episode {k}: mask is not on the sampled ids"
        assert batch.logprobs[k] == lps, f"episode {k}: log-probs are not the engine's, in place"
        full = prompt + response
        for pos in (len(prompt) + j for j, m in enumerate(mask) if m):
            assert batch.logprobs[k][pos - len(prompt)] == pytest.approx(
                script.logprob(full[pos - 1], full[pos]), abs=1e-4), f"episode {k}: log-prob at {pos} shifted"
        info = batch.episode_info[k]
        assert info["token_mismatch"] == 0, info["problems"]
        assert info["turns"] == info["calls"] == len(sampled) and info["rewinds"] == info["restarts"] == 0
        assert batch.episode_rewards[k] == reward == info["tool_calls"]
        all_sampled += sampled
    assert any(script.call in r for r in all_sampled), "no tool call was sampled: the test proves less"
    bodies = [r[:-1] for r in all_sampled if script.call not in r and r[-1] == script.im_end]
    tok = codec.tokenizer
    assert any(tok.encode(tok.decode(b)) != b for b in bodies), \
        "every reply survived decode + encode: a re-tokenized history would pass unnoticed"


def test_gateway_retry_and_branch_go_back_to_recorded_ids(engine, scripted):
    """Guards against a retried call (the openai client resends a call whose response was
    lost) or a branch from an earlier reply being appended after the abandoned reply, or
    re-rendered: the sample must be the recorded ids up to where the agent went back, then
    the new delta and the engine's new reply; the abandoned model tokens are counted."""
    import openai

    _, _, codec = scripted
    gw, spy = make_gateway(engine, scripted)
    with gw.serve() as server:
        client = openai.OpenAI(base_url=server.base_url("retry"), api_key="unused", max_retries=0)
        ask = lambda msgs: client.chat.completions.create(model="m", messages=msgs, tools=TOOLS,  # noqa: E731
                                                          max_tokens=32)  # (a cut: p < 1e-5)
        first = [{"role": "system", "content": "s"}, {"role": "user", "content": "retry me"}]
        a = ask(first)
        b = ask(first)  # the same call again: back to the first prompt
        convo = first + [b.choices[0].message, {"role": "user", "content": "go on"}]
        d = ask(convo)
        branch = first + [b.choices[0].message, {"role": "user", "content": "no, this instead"}]
        c = ask(branch)  # back to the reply of b, a different user turn
        info_live = gw.episode("retry").summary()
        batch = gw.collect(["retry"], default_reward=0.0)
    prompt, response, lps, (mask, sampled) = expected_trajectory(codec, spy, branch + [c.choices[0].message],
                                                                 retried=True)
    assert batch.prompt_ids[0] == prompt and batch.response_ids[0] == response
    assert batch.response_mask[0] == mask and batch.logprobs[0] == lps
    info = batch.episode_info[0]
    assert info_live["rewinds"] == info["rewinds"] == 2 and info["calls"] == 4 and info["turns"] == 2
    assert info["dropped_model_tokens"] == a.usage.completion_tokens + d.usage.completion_tokens
    assert info["token_mismatch"] == 0, info["problems"]


def test_gateway_rewritten_history_is_refused_or_restarted(engine, scripted):
    """Guards against training on a history the agent rewrote: an edited first turn or a
    changed tool list get a 409 and leave the record as it was (a later call that merely
    omits the tools is served, the tools kept in the prompt); with on_rewrite='restart' the
    sample starts again from the new messages and the earlier model tokens leave it."""
    import openai

    _, _, codec = scripted
    first = [{"role": "system", "content": "s"}, {"role": "user", "content": "original"}]
    for policy in ("reject", "restart"):
        gw, spy = make_gateway(engine, scripted, on_rewrite=policy)
        with gw.serve() as server:
            client = openai.OpenAI(base_url=server.base_url("w"), api_key="unused", max_retries=2)
            r = client.chat.completions.create(model="m", messages=first, tools=TOOLS, max_tokens=32)
            edited = [first[0], {"role": "user", "content": "edited"}, r.choices[0].message,
                      {"role": "user", "content": "more"}]
            before = (len(spy.calls), gw.episode("w").summary())
            if policy == "reject":
                with pytest.raises(openai.ConflictError) as e:
                    client.chat.completions.create(model="m", messages=edited, tools=TOOLS, max_tokens=8)
                assert e.value.body["code"] == "history_rewritten" and "messages[1]" in e.value.body["message"]
                with pytest.raises(openai.ConflictError, match="tools differ"):
                    client.chat.completions.create(model="m", messages=first + [r.choices[0].message, first[1]],
                                                   tools=TOOLS + [{"type": "function", "function": {"name": "x"}}])
                assert (len(spy.calls), gw.episode("w").summary()) == before, "a refused call changed the record"
                last = client.chat.completions.create(model="m", messages=first + [r.choices[0].message, first[1]],
                                                      max_tokens=32)  # no tools: kept in the prompt, text reply
                assert not last.choices[0].message.tool_calls and gw.episode("w").summary()["calls"] == 2
                batch = gw.collect(["w"], default_reward=0.0)
                assert batch.episode_info[0]["token_mismatch"] == 0 and batch.episode_info[0]["restarts"] == 0
                continue
            r2 = client.chat.completions.create(model="m", messages=edited, tools=TOOLS, max_tokens=32)
            batch = gw.collect(["w"], default_reward=1.0)
        info = batch.episode_info[0]
        assert info["restarts"] == 1 and info["dropped_model_tokens"] == r.usage.completion_tokens
        assert batch.prompt_ids[0] == codec.first_ids(to_dicts(edited), TOOLS)
        assert batch.response_ids[0] == [t for p, t, _ in spy.turns() if p == batch.prompt_ids[0]][-1]
        assert batch.response_mask[0] == [1] * r2.usage.completion_tokens


def test_gateway_cut_reply_cannot_be_continued_token_exactly(engine, scripted):
    """Guards against appending a delta after a reply the model never closed (cut at
    max_tokens): no rendering of that turn matches its ids, so the call is a 409 naming
    the cut, and a finished episode refuses further calls."""
    import openai

    gw, _ = make_gateway(engine, scripted)
    with gw.serve() as server:
        client = openai.OpenAI(base_url=server.base_url("cut"), api_key="unused", max_retries=0)
        first = [{"role": "user", "content": "cut me"}]
        r = client.chat.completions.create(model="m", messages=first, max_tokens=1)
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 1
        with pytest.raises(openai.ConflictError, match="was cut"):
            client.chat.completions.create(model="m", messages=first + [r.choices[0].message,
                                                                        {"role": "user", "content": "and?"}])
        post(f"{server.url}/episodes/cut/finish", {"reward": 0.5})
        with pytest.raises(openai.ConflictError, match="is finished"):
            client.chat.completions.create(model="m", messages=first)
        batch = gw.collect(["cut"])
    assert batch.finish_reasons == ["length"] and batch.episode_rewards == [0.5]
    assert batch.response_mask == [[1]] and batch.episode_info[0]["token_mismatch"] == 0


def test_gateway_collect_refuses_what_the_trainer_cannot_use(engine, scripted):
    """Guards against a batch the advantage code would misread: groups listed out of
    group-major order, an episode without a reward or without any call, a double listing."""
    import openai

    gw, _ = make_gateway(engine, scripted)
    with gw.serve() as server:
        ids = [gw.open_episode(prompt_index=p) for p in (0, 1, 0, 1)]
        for i in ids:
            openai.OpenAI(base_url=server.base_url(i), api_key="unused").chat.completions.create(
                model="m", messages=[{"role": "user", "content": i}], max_tokens=4)
        with pytest.raises(ValueError, match="group-major"):
            gw.collect([ids[0], ids[1]], group_size=2, default_reward=0.0)
        with pytest.raises(ValueError, match="no reward reported"):
            gw.collect([ids[0], ids[2]], group_size=2)
        with pytest.raises(ValueError, match="listed twice"):
            gw.collect([ids[0], ids[0]], group_size=2)
        idle = gw.open_episode(prompt_index=2)
        with pytest.raises(ValueError, match="no chat call"):
            gw.collect([idle], default_reward=0.0)
        batch = gw.collect([ids[0], ids[2], ids[1], ids[3]], group_size=2, default_reward=0.0)
        assert batch.prompt_index == [0, 0, 1, 1]
        assert raw(server, "GET", f"/episodes/{ids[0]}")[0] == 404  # collected: gone
        late = raw(server, "POST", f"/episodes/{ids[0]}/v1/chat/completions", json.dumps(GOOD).encode())
        assert late[0] == 409 and late[2]["error"]["code"] == "episode_collected"  # not a new episode


def test_gateway_guide_example_runs(engine, scripted):
    """Guards against the guide's complete example drifting from the code (a renamed method,
    a changed collect): its agent and its round of rollouts run against this engine and
    give a group-major, token-exact batch."""
    from tests import REPO

    text = (REPO / "docs" / "guides" / "gateway.md").read_text()
    section = text.split("## A complete example", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```python\n(.*?)^```", section, flags=re.M | re.S)
    assert len(blocks) == 3, len(blocks)
    namespace: dict = {"__name__": "guide"}
    for block in blocks[:2]:  # the third builds an engine from a checkpoint path
        exec(compile(block, "docs/guides/gateway.md", "exec"), namespace)
    gw, _ = make_gateway(engine, scripted)
    with gw.serve() as server:
        batch = namespace["play_round"](gw, server, ["find x", "find y"], group_size=2, step=3)
    assert len(batch) == 4 and batch.prompt_index == [0, 0, 1, 1]
    assert all(i["token_mismatch"] == 0 for i in batch.episode_info), batch.episode_info
    assert all(r in (0.0, 1.0) for r in batch.episode_rewards) and all(map(any, batch.response_mask))


def _react(base_url: str, task: str, turns: int = 3):
    """A ReAct-style agent: no tools in the API, a stop string ends each action; the
    action's observation comes back as a user message. Returns (messages, stopped flags)."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages: list = [{"role": "user", "content": task}]
    stopped = []
    for _ in range(turns):
        r = client.chat.completions.create(model="m", messages=messages, stop=["</tool_call>"], max_tokens=32)
        choice = r.choices[0]
        messages.append({"role": "assistant", "content": choice.message.content})
        stopped.append("lookup" in (choice.message.content or ""))
        messages.append({"role": "user", "content": "Observation: x = 42" if stopped[-1] else "Go on."})
    return messages[:-1], stopped


def test_gateway_stop_string_agent_continues_token_exactly(engine, scripted):
    """Guards against a stop-sequence (ReAct) agent's next call being a 409 and against the
    stop string in ``content`` (OpenAI and vLLM leave it out): each reply ended by the
    agent's stop string comes back without it, the next call continues after the reply's
    sampled ids (the stop string's included) with the end-of-turn token appended outside the
    mask, then the chat format's delta; the recorded ids are exactly that."""
    _, script, codec = scripted
    gw, spy = make_gateway(engine, scripted)
    with gw.serve() as server:
        ids = [gw.open_episode(prompt_index=0, key=k) for k in range(3)]
        played = [_react(server.base_url(i), f"task {k}") for k, i in enumerate(ids)]
        batch = gw.collect(ids, group_size=3, default_reward=0.0)
    continued = 0
    for k, (messages, stopped) in enumerate(played):
        replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        seq = list(codec.first_ids(messages[:1], []))
        prompt_len, mask = len(seq), []
        for j, at in enumerate(replies):
            m = messages[at]
            if j:
                prev = replies[j - 1]
                close = [script.im_end] if stopped[j - 1] else []
                delta = close + codec.delta_ids(to_dicts(messages[:prev + 1]), to_dicts(messages[prev + 1:at]), [])
                seq, mask = seq + delta, mask + [0] * len(delta)
                continued += bool(close)
            r = [r for p, r, _ in spy.turns() if p == seq]
            assert len(r) == 1, f"episode {k} reply {j}: {len(r)} engine calls continued the expected ids"
            seq, mask = seq + r[0], mask + [1] * len(r[0])
            if stopped[j]:
                assert r[0][-1] == script.call and "</tool_call>" not in m["content"] and m["content"], m
        assert batch.prompt_ids[k] == seq[:prompt_len] and batch.response_ids[k] == seq[prompt_len:]
        assert batch.response_mask[k] == mask
        assert batch.episode_info[k]["token_mismatch"] == 0, batch.episode_info[k]["problems"]
        assert batch.episode_info[k]["calls"] == len(replies) == 3
    assert continued, "no reply ended on the stop string and was continued; the test proves less"
