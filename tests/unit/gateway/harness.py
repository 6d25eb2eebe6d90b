"""Helpers of the gateway tests: a spy on the engine, a gateway per test, raw HTTP, the
agent (plain openai-client code) and the trajectory it must leave, built independently of
the gateway from the engine's own outputs and the chat format's ids."""
from __future__ import annotations

import http.client
import json
import urllib.request

from grpo_mega.gateway import Gateway, GatewayConfig
from grpo_mega.rollout.types import RolloutBatch, SamplingConfig
from tests.unit.gateway.scripted import TOOLS

MAX_MODEL_LEN = 512
GOOD = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


class Spy:
    """Calls the real engine and keeps what it was given and what it returned."""

    def __init__(self, generate):
        self.generate, self.calls, self.attempts, self.asked = generate, [], [], []

    def __call__(self, prompts, sampling, **kw) -> RolloutBatch:
        self.attempts.append(len(prompts))
        self.asked.append((sampling, kw))  # the sampling, step, seed keys and budgets of each call
        out = self.generate(prompts, sampling, **kw)
        self.calls.append(([list(p) for p in prompts], out))
        return out

    def turns(self):
        for prompts, out in self.calls:
            yield from zip(prompts, out.response_ids, out.logprobs)


def make_gateway(engine, scripted, **config) -> tuple[Gateway, Spy]:
    _, script, codec = scripted
    spy = Spy(engine.generate)
    sampling = SamplingConfig(max_new_tokens=32, seed=7)  # the gateway adds codec.eot_id as a stop
    return Gateway(spy, codec, sampling, GatewayConfig(**{"max_model_len": MAX_MODEL_LEN, **config})), spy


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def raw(server, method: str, path: str, body: bytes | None = None, headers: dict | None = None, conn=None):
    """One raw HTTP exchange (on ``conn``, kept alive, when given): (status, headers, JSON body)."""
    own = conn is None
    conn = conn or http.client.HTTPConnection(server.host, server.port, timeout=60)
    conn.request(method, path, body=body, headers=headers or {})
    r = conn.getresponse()
    data = r.read()
    if own:
        conn.close()
    return r.status, dict(r.getheaders()), json.loads(data)


def run_agent(base_url: str, task: str, max_turns: int = 4, as_dicts: bool = False):
    """Looks a key up until the model stops calling the tool; returns (reward, messages)."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages: list = [{"role": "system", "content": "Answer with the lookup tool."},
                      {"role": "user", "content": task}]
    calls = 0
    for _ in range(max_turns):
        r = client.chat.completions.create(model="any-model", messages=messages, tools=TOOLS, max_tokens=8)
        choice = r.choices[0]
        messages.append(choice.message.model_dump(exclude_none=True) if as_dicts else choice.message)
        if choice.finish_reason == "tool_calls":
            for call in choice.message.tool_calls:
                key = json.loads(call.function.arguments)["key"]
                messages.append({"role": "tool", "tool_call_id": call.id, "content": f"{key} = 42"})
                calls += 1
        elif choice.finish_reason == "stop":
            messages.append({"role": "user", "content": "Use the tool, please."})
        else:
            break  # cut at max_tokens
    return float(calls), messages


def _is_reply(m) -> bool:
    return not isinstance(m, dict) or m["role"] == "assistant"


def expected_trajectory(codec, spy: Spy, messages: list, retried: bool = False):
    """Prompt ids + the engine's sampled ids + the delta ids of the agent's added messages,
    built from the engine's own outputs (each reply is found by the prompt it continued; the
    latest such call where the agent ``retried``); returns (prompt, response, log-probs,
    (mask, sampled replies))."""
    replies = [i for i, m in enumerate(messages) if _is_reply(m)]
    seq = list(codec.first_ids(messages[:replies[0]], TOOLS))
    prompt_len, mask, lps, sampled = len(seq), [], [], []
    for k, i in enumerate(replies):
        if k:
            delta = codec.delta_ids(to_dicts(messages[:replies[k - 1] + 1]), to_dicts(messages[replies[k - 1] + 1:i]),
                                    TOOLS)
            seq += delta
            mask += [0] * len(delta)
            lps += [0.0] * len(delta)
        match = [(r, lp) for p, r, lp in spy.turns() if p == seq]
        assert len(match) == 1 or (retried and match), f"reply {k}: {len(match)} engine calls continued these ids"
        r, lp = match[-1]
        seq += r
        mask += [1] * len(r)
        lps += lp
        sampled.append(r)
    return seq[:prompt_len], seq[prompt_len:], lps, (mask, sampled)


def to_dicts(messages: list) -> list[dict]:
    from grpo_mega.gateway.openai_api import normalize_message

    return [normalize_message(m if isinstance(m, dict) else m.model_dump(exclude_none=True)) for m in messages]
