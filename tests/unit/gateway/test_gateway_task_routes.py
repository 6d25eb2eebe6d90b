"""Hostile requests to the routes trainer mode added (``POST /tasks/next``, ``POST
/episodes/<id>/finish``): refused with the right status, the key checked before a body is
read, and nothing handed out or changed by a refused request. No model and no engine: the
real server and chat format, with an engine that must never be reached.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/gateway/test_gateway_task_routes.py
"""
from __future__ import annotations

import json

from grpo_mega.gateway import Gateway, GatewayConfig
from tests.unit.gateway.test_gateway_limits import AUTH, KEY, exchange, post

TASK = {"messages": [{"role": "user", "content": "2*3="}], "answer": "6"}


def _gateway(codec) -> Gateway:
    gw = Gateway(None, codec, config=GatewayConfig(api_key=KEY, read_timeout_s=10, max_body_bytes=2**16,
                                                   auto_open=False))
    gw.open_episode("e0", prompt_index=0, task=TASK)
    gw.open_episode("e1", prompt_index=0, task=TASK)
    return gw


def _status(server, path: str, body: str, extra: str = AUTH) -> tuple[int, dict]:
    status, _, reply = exchange(server, post(path, body.encode(), extra))
    return status, json.loads(reply) if reply else {}


def test_gateway_task_routes_check_the_key_before_the_body_and_hand_out_nothing(chatml_codec):
    """Guards against an unauthenticated or oversized request to the trainer's routes being
    read (the key must be checked from the headers: a client announcing a body it never
    sends is answered 401 at once, not timed out) or acting: a refused ``/tasks/next`` must
    not hand a task out (the agent would never see that episode and the rollout would wait
    for it), a refused ``finish`` must not end an episode. Oversized bodies are 413, unread."""
    gw = _gateway(chatml_codec)
    with gw.serve() as server:
        head = "POST {} HTTP/1.1\r\nHost: x\r\n{}Content-Length: {}\r\n\r\n"
        for path in ("/tasks/next", "/episodes/e0/finish"):
            for what, auth, length, status in (("no key", "", 4096, 401),
                                               ("wrong key", "Authorization: Bearer k2\r\n", 4096, 401),
                                               ("key as a prefix", "Authorization: Bearer kk\r\n", 10, 401),
                                               ("too large", AUTH, 2**16 + 1, 413)):
                got, headers, body = exchange(server, head.format(path, auth, length).encode(), timeout=3)
                assert got == status, f"{path} {what}: {got} {body[:200]!r}"
                assert headers.get("connection") == "close", f"{path} {what}: the unread body would be parsed"
        assert server.httpd.stats["body_bytes_read"] == 0, "a refused body was read"
        assert gw.unfinished(["e0", "e1"]) == ["e0", "e1"], "a refused finish ended an episode"
        assert exchange(server, b"GET /tasks/next HTTP/1.1\r\nHost: x\r\n" + AUTH.encode() + b"\r\n")[0] == 405
        handed = [gw.next_task(0.0)["episode_id"], gw.next_task(0.0)["episode_id"]]
        assert handed == ["e0", "e1"], "a refused request took a task"
        assert gw.next_task(0.0) is None


def test_gateway_task_routes_refuse_bad_bodies_unknown_episodes_and_a_second_finish(chatml_codec):
    """Guards against malformed input to the trainer's routes being served or answered 500:
    bad JSON, a wait that is negative, NaN, huge or not a number (``/tasks/next`` holds a
    thread that long) and a reward that is NaN, infinite, beyond +-1e6, a string or a bool
    are 400s that hand out and change nothing; an unknown episode is 404; a second finish,
    or a reward after the finish, is 409 and leaves the first reward (the trainer may be
    collecting it); a negative finite reward is a reward."""
    gw = _gateway(chatml_codec)
    with gw.serve() as server:
        for body in ("{", '{"wait": -1}', '{"wait": NaN}', '{"wait": 1e9}', '{"wait": true}', '{"wait": "5"}',
                     "[]", '"x"'):
            status, reply = _status(server, "/tasks/next", body)
            assert status == 400 and reply["error"]["type"] == "invalid_request_error", (body, status, reply)
        for body in ("{", '{"reward": NaN}', '{"reward": Infinity}', '{"reward": 1e999}', '{"reward": -1e999}',
                     '{"reward": 1e7}', '{"reward": "1.0"}', '{"reward": true}', '{"reward": [1]}', "null"):
            status, reply = _status(server, "/episodes/e1/finish", body)
            assert status == 400, (body, status, reply)
            assert _status(server, "/episodes/e1/reward", body)[0] == 400, body
        assert gw.unfinished(["e1"]) == ["e1"] and gw.episode("e1").reward is None
        for path in ("/episodes/nobody/finish", "/episodes/..%2Fe0/finish", "/episodes/" + "a" * 200 + "/finish"):
            status, reply = _status(server, path, '{"reward": 1.0}')
            assert status == 404 and reply["error"]["code"] == "episode_not_found", (path, status, reply)
        assert _status(server, "/episodes/e0/finish", '{"reward": -1.5}')[0] == 200
        for path, body in (("/episodes/e0/finish", '{"reward": 1.0}'), ("/episodes/e0/finish", "{}"),
                           ("/episodes/e0/reward", '{"reward": 1.0}')):
            status, reply = _status(server, path, body)
            assert status == 409 and reply["error"]["code"] == "episode_finished", (path, body, status, reply)
        assert gw.episode("e0").reward == -1.5
        status, reply = _status(server, "/tasks/next", '{"wait": 0}')
        assert status == 200 and reply["episode_id"] == "e0" and reply["answer"] == "6", reply
        assert reply["base_url"].endswith("/episodes/e0/v1")
