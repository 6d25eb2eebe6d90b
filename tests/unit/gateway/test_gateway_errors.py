"""The gateway's refusals and failures: clear 4xx/5xx in OpenAI's shape, never a dead
server; loopback by default. The real ``openai`` client and raw HTTP against the real
server, the real vLLM engine behind it (``conftest.py``).

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/gateway/test_gateway_errors.py
"""
from __future__ import annotations

import http.client
import importlib.util
import json
import socket
import threading

import pytest

from grpo_mega.gateway import Gateway, GatewayConfig, is_loopback
from grpo_mega.rollout.types import SamplingConfig
from tests.unit.gateway.harness import GOOD, make_gateway, raw

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("openai") is None, reason="the openai client is not installed")]


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


@pytest.mark.vllm
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


@pytest.mark.vllm
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


@pytest.mark.vllm
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
