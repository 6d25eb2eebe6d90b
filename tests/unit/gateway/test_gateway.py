"""The OpenAI-compatible gateway: the real ``openai`` client against the real server on
loopback, in front of a real vLLM engine on CPU.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/gateway

One engine for the module (``engine``), serving a scripted tiny Qwen2 (``scripted.py``:
its next-token log-probs are known exactly; it writes tool calls, and replies whose bytes
do not survive decode + encode) with the real ChatML chat format (``rollout.chat_codec``).
Each test starts its own gateway and server (milliseconds).
"""
from __future__ import annotations

import http.client
import importlib.util
import json
import socket
import threading
import urllib.request

import pytest

from grpo_mega.gateway import Gateway, GatewayConfig, is_loopback
from grpo_mega.rollout.types import RolloutBatch, SamplingConfig
from tests.unit.gateway.scripted import TOOLS, build_scripted_model

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
HAVE_OPENAI = importlib.util.find_spec("openai") is not None
pytestmark = [pytest.mark.skipif(not HAVE_OPENAI, reason="the openai client is not installed")]
needs_engine = [pytest.mark.vllm, pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed")]
MAX_MODEL_LEN = 512


# ---------------------------------------------------------------------------
# Fixtures: one scripted model and engine; a spy on what the engine returned
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    from grpo_mega.data.tokenizer import HFTokenizer
    from grpo_mega.rollout.chat_codec import ChatCodec

    model, script = build_scripted_model(tmp_path_factory.mktemp("gateway"))
    return model, script, ChatCodec.for_tokenizer(HFTokenizer(model), "chatml")


@pytest.fixture(scope="module")
def engine(scripted):
    if not HAVE_VLLM:
        pytest.skip("vllm is not installed")
    from grpo_mega.rollout import EngineConfig, RolloutEngine

    eng = RolloutEngine(EngineConfig(str(scripted[0]), max_model_len=MAX_MODEL_LEN), SamplingConfig(n=1))
    yield eng
    eng.shutdown()


class Spy:
    """Calls the real engine and keeps what it was given and what it returned."""

    def __init__(self, generate):
        self.generate, self.calls, self.attempts = generate, [], []

    def __call__(self, prompts, sampling, **kw) -> RolloutBatch:
        self.attempts.append(len(prompts))
        out = self.generate(prompts, sampling, **kw)
        self.calls.append(([list(p) for p in prompts], out))
        return out

    def turns(self):
        for prompts, out in self.calls:
            yield from zip(prompts, out.response_ids, out.logprobs)


def make_gateway(engine, scripted, **config) -> tuple[Gateway, Spy]:
    _, script, codec = scripted
    spy = Spy(engine.generate)
    sampling = SamplingConfig(max_new_tokens=8, seed=7)  # the gateway adds codec.eot_id as a stop
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


# ---------------------------------------------------------------------------
# The agent: what a user writes for the openai client, unmodified
# ---------------------------------------------------------------------------

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
            delta = codec.delta_ids(_dicts(messages[:replies[k - 1] + 1]), _dicts(messages[replies[k - 1] + 1:i]),
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


# ---------------------------------------------------------------------------
# Token-exact recording through the real client
# ---------------------------------------------------------------------------

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


def _dicts(messages: list) -> list[dict]:
    from grpo_mega.gateway.openai_api import normalize_message

    return [normalize_message(m if isinstance(m, dict) else m.model_dump(exclude_none=True)) for m in messages]


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
        assert batch.prompt_ids[0] == codec.first_ids(_dicts(edited), TOOLS)
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


# ---------------------------------------------------------------------------
# Refusals and failures: clear 4xx/5xx in OpenAI's shape, never a dead server
# ---------------------------------------------------------------------------

GOOD = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
BAD_REQUESTS = [  # (what, method, path, body, status, code or param it must name)
    ("malformed JSON", "POST", "/episodes/e/v1/chat/completions", b'{"messages": [', 400, "invalid_json"),
    ("not UTF-8", "POST", "/episodes/e/v1/chat/completions", b"\xff\xfe", 400, "invalid_json"),
    ("NaN", "POST", "/episodes/e/v1/chat/completions", b'{"messages": [], "temperature": NaN}', 400, "invalid_json"),
    ("a list body", "POST", "/episodes/e/v1/chat/completions", [], 400, None),
    ("no messages", "POST", "/episodes/e/v1/chat/completions", {"model": "m"}, 400, "messages"),
    ("empty messages", "POST", "/episodes/e/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("unknown role", "POST", "/episodes/e/v1/chat/completions",
     {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("tool reply without id", "POST", "/episodes/e/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]}, 400,
     "messages[1].tool_call_id"),
    ("image content", "POST", "/episodes/e/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages[0].content[0]"),
    ("tool name with a space", "POST", "/episodes/e/v1/chat/completions",
     {**GOOD, "tools": [{"type": "function", "function": {"name": "look up"}}]}, 400, "tools[0].function.name"),
    ("tool parameters not an object", "POST", "/episodes/e/v1/chat/completions",
     {**GOOD, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, 400,
     "tools[0].function.parameters"),
    ("tool of another type", "POST", "/episodes/e/v1/chat/completions",
     {**GOOD, "tools": [{"type": "code_interpreter"}]}, 400, "tools[0]"),
    ("n=2", "POST", "/episodes/e/v1/chat/completions", {**GOOD, "n": 2}, 400, "n"),
    ("stream", "POST", "/episodes/e/v1/chat/completions", {**GOOD, "stream": True}, 400, "stream"),
    ("temperature 5", "POST", "/episodes/e/v1/chat/completions", {**GOOD, "temperature": 5}, 400, "temperature"),
    ("max_tokens 0", "POST", "/episodes/e/v1/chat/completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    ("forced tool choice", "POST", "/episodes/e/v1/chat/completions", {**GOOD, "tool_choice": "required"},
     400, "tool_choice"),
    ("a penalty", "POST", "/episodes/e/v1/chat/completions", {**GOOD, "presence_penalty": 1.0}, 400,
     "presence_penalty"),
    ("unknown parameter", "POST", "/episodes/e/v1/chat/completions", {**GOOD, "best_of": 3}, 400, "best_of"),
    ("bad episode id", "POST", "/episodes/a%20b/v1/chat/completions", GOOD, 400, "id"),
    ("no episode in the URL", "POST", "/v1/chat/completions", GOOD, 404, "episode_required"),
    ("unknown path", "GET", "/v2/anything", None, 404, "not_found"),
    ("unknown path with a body", "POST", "/v2/anything", GOOD, 404, "not_found"),
    ("wrong method", "GET", "/episodes/e/v1/chat/completions", None, 405, None),
    ("wrong method with a body", "PUT", "/episodes/e/v1/chat/completions", GOOD, 405, None),
    ("reward not a number", "POST", "/episodes/e/reward", {"reward": "high"}, 400, "reward"),
    ("reward to no episode", "POST", "/episodes/nobody/reward", {"reward": 1.0}, 404, "episode_not_found"),
    ("too large", "POST", "/episodes/e/v1/chat/completions", b"{" + b" " * 5000 + b"}", 413, None),
]


def test_gateway_bad_requests_get_clear_openai_shaped_4xx(engine, scripted):
    """Guards against a bad request crashing the server or getting a vague answer: each gets
    its 4xx in OpenAI's error shape naming the bad field, with ``x-should-retry: false`` (the
    openai client would otherwise retry), all on one kept-alive connection (an unread body
    would be read as the next request); the server then still serves, and the openai client
    raises its typed error."""
    import openai

    gw, spy = make_gateway(engine, scripted, max_body_bytes=4096)
    with gw.serve() as server:
        conn = http.client.HTTPConnection(server.host, server.port, timeout=60)  # kept alive throughout
        for what, method, path, body, status, named in BAD_REQUESTS:
            data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
            got, headers, reply = raw(server, method, path, data, {"Content-Type": "application/json"}, conn)
            assert got == status, f"{what}: {got} {reply}"
            err = reply["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], what
            assert err["type"] == "invalid_request_error" and headers.get("x-should-retry") == "false", what
            assert named is None or named in (err["param"], err["code"]), f"{what}: names {err}"
        assert raw(server, "GET", "/health", conn=conn)[0] == 200, "a refusal left the connection unusable"
        conn.close()
        with socket.create_connection((server.host, server.port), timeout=60) as sock:  # not even HTTP
            sock.sendall(b"GET /a b HTTP/1.1\r\n\r\n")
            reply = sock.makefile("rb").read()
        assert reply.startswith(b"HTTP/") and b" 400 " in reply.split(b"\r\n")[0]
        assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["type"] == "invalid_request_error"
        assert not spy.calls, "a refused request reached the engine"
        client = openai.OpenAI(base_url=server.base_url("e"), api_key="unused")
        with pytest.raises(openai.BadRequestError, match="n=1"):
            client.chat.completions.create(model="m", messages=GOOD["messages"], n=2)
        assert [m.id for m in client.models.list().data] == ["grpo-mega"]
        ok = client.chat.completions.create(model="m", messages=GOOD["messages"], max_tokens=32)
        assert ok.choices[0].finish_reason in ("stop", "tool_calls") and ok.usage.total_tokens > 0
        long = [{"role": "user", "content": "word " * 600}]
        with pytest.raises(openai.BadRequestError, match="no room") as e:
            openai.OpenAI(base_url=server.base_url("e2"), api_key="unused").chat.completions.create(
                model="m", messages=long)
        assert e.value.body["code"] == "context_length_exceeded"
        assert raw(server, "GET", "/health")[0] == 200


def test_gateway_engine_refusal_is_400_and_failure_is_5xx_with_the_reason(engine, scripted):
    """Guards against an engine error killing the server, failing the other calls of its
    batch, or reaching the client as a vague error: the engine's refusal of a request (a
    prompt over its context) is a 400 with its words while the call batched with it is
    served; an engine that fails is a 500 with the reason; neither changes the episode."""
    import openai

    _, _, codec = scripted
    # No max_model_len: the engine itself judges the length. A long wait: both calls share a batch.
    gw, spy = make_gateway(engine, scripted, max_model_len=None, batch_wait_s=0.5, request_timeout_s=60)
    with gw.serve() as server:
        got, start = {}, threading.Barrier(2)

        def call(name, text):
            client = openai.OpenAI(base_url=server.base_url(name), api_key="unused", max_retries=0)
            start.wait()
            try:
                got[name] = client.chat.completions.create(model="m", messages=[{"role": "user", "content": text}],
                                                           max_tokens=32)
            except openai.APIError as e:
                got[name] = e

        threads = [threading.Thread(target=call, args=a) for a in (("long", "word " * 600), ("short", "hi"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert 2 in spy.attempts, "the two calls were not batched together; the test proves less"
        assert isinstance(got["long"], openai.BadRequestError) and got["long"].body["code"] == "engine_refused"
        assert "max_model_len" in got["long"].body["message"]
        assert not isinstance(got["short"], Exception), f"a good call failed with a bad one: {got['short']}"
        assert gw.episode("long").summary()["calls"] == 0 and gw.episode("short").summary()["calls"] == 1

    def broken_engine(prompts, sampling, **kw):  # stands in for an engine that died
        raise RuntimeError("out of KV cache blocks")

    gw = Gateway(broken_engine, codec, SamplingConfig(max_new_tokens=4))
    with gw.serve() as server:
        client = openai.OpenAI(base_url=server.base_url("x"), api_key="unused", max_retries=0)
        with pytest.raises(openai.InternalServerError, match="out of KV cache blocks") as e:
            client.chat.completions.create(model="m", messages=GOOD["messages"])
        assert e.value.status_code == 500 and e.value.body["type"] == "server_error"
        assert gw.episode("x").summary()["calls"] == 0 and raw(server, "GET", "/health")[0] == 200


def test_gateway_api_key_is_checked_when_set(engine, scripted):
    """Guards against an api_key that is configured but not enforced (the guard for a
    gateway bound beyond loopback)."""
    import openai

    gw, _ = make_gateway(engine, scripted, api_key="s3cret")
    with gw.serve() as server:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.base_url("k"), api_key="wrong", max_retries=0).models.list()
        assert openai.OpenAI(base_url=server.base_url("k"), api_key="s3cret").models.list().data


def _outside_address() -> str | None:
    """A non-loopback address of this machine (None where it has none)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("192.0.2.255", 9))  # no packet is sent; the kernel picks the outgoing address
        addr = s.getsockname()[0]
    except OSError:
        return None
    finally:
        s.close()
    return None if is_loopback(addr) else addr


def test_gateway_listens_on_loopback_by_default_and_warns_otherwise(scripted, caplog):
    """Guards against a gateway reachable from the network by default (it runs the model for
    anyone and writes what they send into training data): the default server answers on
    127.0.0.1 and refuses connections to the machine's other address; binding elsewhere is
    logged as a warning."""
    _, _, codec = scripted
    assert GatewayConfig().host == "127.0.0.1"
    assert [is_loopback(h) for h in ("127.0.0.1", "localhost", "::1", "0.0.0.0", "192.0.2.2")] == \
        [True, True, True, False, False]
    gw = Gateway(lambda *a, **k: None, codec)
    outside = _outside_address()
    with gw.serve() as server:
        assert server.host == "127.0.0.1" and raw(server, "GET", "/health")[0] == 200
        if outside is not None:
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection((outside, server.port), timeout=5).close()
    if outside is not None:
        with caplog.at_level("WARNING", logger="grpo_mega.gateway.http"):
            with Gateway(lambda *a, **k: None, codec).serve(host=outside):
                pass
        assert "NOT a loopback address" in caplog.text and "api_key" in caplog.text


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
    import re

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
