"""The HTTP server: routes, JSON in and out, OpenAI's error shape, loopback by default,
every resource a client can make it hold bounded (``gateway.limits`` states the bounds).

Built on the standard library's ``ThreadingHTTPServer`` rather than FastAPI/uvicorn, which
vLLM installs. Weighed (uvicorn 0.54, the version the CPU environment has): uvicorn's
``limit_concurrency`` answers 503 only once a request's headers are complete, so
half-sent requests still hold connections; its ``timeout_keep_alive`` starts only after a
response, so a connection that sends part of a request (or nothing) has no timeout; it has
no body-size limit and no deadline on reading a body (the app must count and time what it
receives); and it needs an event loop in the trainer's process plus a thread pool for the
gateway's blocking calls. Every bound would still be ours to write. The standard library
needs no dependency (fastapi and uvicorn are not in ``install_requires``: they come only
with vLLM, through the ``cpu``/``gpu`` extras, in versions vLLM picks, and the gateway
serves any ``generate`` function, with or without vLLM), starts in milliseconds, and a
thread per connection calling the blocking :class:`~grpo_mega.gateway.core.Gateway` is
simple. Its weak points are bounded here: threads by a connection cap enforced before a
thread is started, time by a deadline thread (``limits.Deadlines``), memory by header,
body and total-body caps. It speaks HTTP/1.1 with keep-alive (the openai client reuses its
connections) and no streaming (``stream=true`` is a 400).

Routes (``<id>``: an episode id; the agent's ``base_url`` is ``<url>/episodes/<id>/v1``):

==========================================  ===========================================
``POST /episodes/<id>/v1/chat/completions``  a chat completion, recorded in the episode
``GET  /v1/models``, ``/episodes/<id>/v1/models``  the served model
``POST /episodes``                           open one: ``{"id"?, "prompt_index"?, "metadata"?}``
                                             -> 201 ``{"id", "base_url"}``
``GET  /episodes/<id>``                      the episode's counters
``POST /episodes/<id>/reward``               ``{"reward": float}``
``POST /episodes/<id>/finish``               ``{"reward"?: float}``; later calls get 409
``POST /tasks/next``                         ``{"wait"?: s}``: the next episode to play (trainer mode)
``GET  /health``                             ``{"status": "ok"}``
==========================================  ===========================================

Every refusal is JSON in OpenAI's error shape with a 4xx status and the header
``x-should-retry: false`` (the openai client would otherwise retry a 409 twice); a failure
of the engine is a 5xx with the reason; a cap on connections or body bytes is a 503 with
``Retry-After: 1`` and ``x-should-retry: true``. The API key is checked from the headers
before a body is read. No request can stop the server: an unexpected exception in a
handler is logged and answered 500.
"""
from __future__ import annotations

import hmac
import http.client
import ipaddress
import json
import logging
import re
import socket
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional
from urllib.parse import urlsplit

from grpo_mega.gateway.limits import (
    ByteBudget, Deadlines, HeaderBudget, busy_response, parse_json_object, refuse_connection,
)
from grpo_mega.gateway.openai_api import GatewayError, error_body, models_response

__all__ = ["GatewayServer", "is_loopback"]

log = logging.getLogger(__name__)

_EP = r"/episodes/(?P<id>[^/]+)"
_MAX_TASK_WAIT_S = 60.0
"""Longest an agent's ``POST /tasks/next`` waits for a task (its connection's thread is held)."""
_ROUTES = [
    ("POST", re.compile(rf"^{_EP}/v1/chat/completions$"), "chat"),
    ("GET", re.compile(rf"^(?:{_EP})?/v1/models$"), "models"),
    ("POST", re.compile(r"^/v1/chat/completions$"), "no_episode"),
    ("POST", re.compile(r"^/episodes$"), "open"),
    ("GET", re.compile(rf"^{_EP}$"), "show"),
    ("POST", re.compile(rf"^{_EP}/reward$"), "reward"),
    ("POST", re.compile(rf"^{_EP}/finish$"), "finish"),
    ("GET", re.compile(r"^/health$"), "health"),
    ("POST", re.compile(r"^/tasks/next$"), "next_task"),
]


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is a loopback address."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Dropped(Exception):
    """The connection is given up without an answer (its deadline passed, or the client left)."""


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 512  # the accept backlog: a burst of connections waits in the kernel, not dropped

    def __init__(self, address, handler, gateway: Any):
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.gateway = gateway
        cfg = gateway.config
        super().__init__(address, handler)  # binds first: a port in use leaves no deadline thread behind
        self.deadlines = Deadlines()
        self.bodies = ByteBudget(cfg.max_total_body_bytes)
        self.stats = {"connections": 0, "connections_refused": 0, "body_bytes_read": 0}
        """Counters the tests read: connections open now, refused at the cap, body bytes read."""
        self._stats_lock = threading.Lock()
        self._busy = busy_response(503, f"the gateway serves at most {cfg.max_connections} connections at once "
                                   "(GatewayConfig.max_connections); retry shortly", "too_many_connections")
        self._warned = 0.0

    def count(self, key: str, n: int = 1) -> None:
        with self._stats_lock:
            self.stats[key] += n

    def process_request(self, request, client_address) -> None:
        # Runs on the accepting thread: the cap is applied before a thread exists.
        with self._stats_lock:
            full = self.stats["connections"] >= self.gateway.config.max_connections
            self.stats["connections_refused" if full else "connections"] += 1
        if full:
            refuse_connection(request, self._busy)
            if time.monotonic() - self._warned > 10:  # one line per burst, not one per connection
                self._warned = time.monotonic()
                log.warning("gateway: %d connections open, refusing more (GatewayConfig.max_connections)",
                            self.gateway.config.max_connections)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: give the slot back
            self.count("connections", -1)
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:  # noqa: BLE001 - as the standard library's, but the slot is always given back
            self.handle_error(request, client_address)
        finally:
            self.deadlines.forget(request)
            self.shutdown_request(request)
            self.count("connections", -1)

    def server_close(self) -> None:
        super().server_close()
        self.deadlines.close()

    def handle_error(self, request, client_address) -> None:
        # A client that went away mid-response (the stdlib prints a traceback to stderr).
        log.debug("gateway: connection from %s failed", client_address, exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "grpo-mega-gateway"
    server: _Server

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's naming
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def do_PUT(self) -> None:  # noqa: N802
        self._dispatch("PUT")

    def do_DELETE(self) -> None:  # noqa: N802
        self._dispatch("DELETE")

    def send_error(self, code: int, message: Optional[str] = None, explain: Optional[str] = None) -> None:
        # The stdlib's own refusals (a malformed request line, an unsupported method, headers
        # too large) in OpenAI's JSON error shape too, rather than an HTML page.
        self.close_connection = True
        self._send(code, error_body(code, explain or message or HTTPStatus(code).phrase))

    def handle_expect_100(self) -> bool:
        # The stdlib answers "100 Continue" while parsing the headers, which invites the body
        # before the key and the size are checked; ``_read_body`` sends it after the checks.
        self._expect_100 = True
        return True

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("gateway %s - " + fmt, self.address_string(), *args)

    # -- one request, within its bounds ---------------------------------------
    def handle_one_request(self) -> None:
        """The standard library's, with an idle timeout before the request's first byte,
        one deadline for the rest of it, and a cap on the header bytes."""
        cfg, sock = self.server.gateway.config, self.connection
        self.close_connection, self._expect_100 = True, False
        try:
            sock.settimeout(cfg.idle_timeout_s)
            if not self.rfile.peek(1):
                return  # the client closed the connection
            sock.settimeout(cfg.read_timeout_s)
            self.server.deadlines.arm(sock, cfg.read_timeout_s)
            rfile, self.rfile = self.rfile, HeaderBudget(self.rfile, cfg.max_header_bytes)
            try:
                self.raw_requestline = self.rfile.readline(65537)
                if not self.raw_requestline:
                    return
                parsed = self.parse_request()  # answers a malformed request itself
            except http.client.LineTooLong as e:
                self.requestline = self.request_version = self.command = ""
                self.send_error(431, None, str(e))
                return
            finally:
                self.rfile = rfile
            if not parsed:
                return
            method = getattr(self, f"do_{self.command}", None)
            if method is None:
                self.send_error(501, None, f"unsupported method {self.command!r}")
                return
            method()
        except (OSError, _Dropped):  # a timeout, the deadline's shutdown, a client gone
            self.close_connection = True
        finally:
            self.server.deadlines.disarm(sock)

    def _dispatch(self, method: str) -> None:
        held = 0
        try:
            try:
                self._authorized()  # from the headers alone: not a byte of the body is read before
                held = self._reserve_body()
                raw = self._read_body(held)
                if not self.server.deadlines.disarm(self.connection):
                    raise _Dropped()  # the request came in late; the deadline shut the socket
                status, payload = self._route(method, raw)
            except GatewayError as e:
                status, payload = e.status, e.body()
            except _Dropped:
                raise
            except Exception as e:  # noqa: BLE001 - a handler bug answers 500, the server lives on
                log.exception("gateway: unexpected error on %s %s", method, self.path)
                status, payload = 500, error_body(500, f"internal error: {type(e).__name__}: {e}")
            self._send(status, payload)
        finally:
            if held:
                self.server.bodies.give(held)

    def _send(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.server.deadlines.arm(self.connection, self.server.gateway.config.read_timeout_s)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if 400 <= status < 500:
            self.send_header("x-should-retry", "false")
        elif status == 503 and (payload.get("error") or {}).get("code") == "too_many_body_bytes":
            self.send_header("Retry-After", "1")
            self.send_header("x-should-retry", "true")
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)
        if not self.server.deadlines.disarm(self.connection):
            raise _Dropped()

    def _reserve_body(self) -> int:
        """The body's length from its headers, checked and reserved before any of it is read.
        Any refusal here leaves the body unread, so the connection is closed after the answer."""
        if "Transfer-Encoding" in self.headers:
            self.close_connection = True
            raise GatewayError(411, "send the body with a Content-Length (chunked and other transfer "
                               "codings are not read)")
        sent = set(self.headers.get_all("Content-Length") or [])
        if not sent:
            return 0
        value = sent.pop().strip()
        if sent or not value.isdigit() or not value.isascii():
            self.close_connection = True
            raise GatewayError(400, "Content-Length must be one decimal number")
        length, cfg = int(value), self.server.gateway.config
        if length > cfg.max_body_bytes:
            self.close_connection = True
            raise GatewayError(413, f"request body of {length} bytes exceeds {cfg.max_body_bytes} "
                               "(GatewayConfig.max_body_bytes)")
        if length and not self.server.bodies.take(length):
            self.close_connection = True
            raise GatewayError(503, f"the gateway holds {cfg.max_total_body_bytes} bytes of request bodies "
                               "already (GatewayConfig.max_total_body_bytes); retry shortly",
                               code="too_many_body_bytes")
        return length

    def _read_body(self, length: int) -> bytes:
        if not length:
            return b""
        if self._expect_100:
            self.send_response_only(100)
            self.end_headers()
        data = self.rfile.read(length)  # never more than the length announced
        self.server.count("body_bytes_read", len(data))
        if len(data) < length:
            raise _Dropped()  # the client left, or the deadline shut the socket, mid-body
        return data

    def _authorized(self) -> None:
        key = self.server.gateway.config.api_key
        if key is None:
            return
        sent = self.headers.get("Authorization", "")
        if not hmac.compare_digest(sent.encode(), f"Bearer {key}".encode()):
            if "Content-Length" in self.headers or "Transfer-Encoding" in self.headers:
                self.close_connection = True  # its body stays unread
            raise GatewayError(401, "missing or wrong API key (Authorization: Bearer ...; the openai "
                               "client's api_key=)", code="invalid_api_key")

    def _route(self, method: str, raw: bytes) -> tuple[int, dict]:
        path = urlsplit(self.path).path.rstrip("/") or "/"
        allowed = []
        for m, pattern, name in _ROUTES:
            match = pattern.match(path)
            if match is None:
                continue
            if m != method:
                allowed.append(m)
                continue
            body = parse_json_object(raw, self.server.gateway.config.max_json_depth) if method == "POST" else None
            return getattr(self, f"_{name}")(match.groupdict().get("id"), body)
        if allowed:
            raise GatewayError(405, f"{method} {path} is not allowed; use {' or '.join(sorted(set(allowed)))}")
        raise GatewayError(404, f"no route {method} {path}; an agent's base_url is "
                           f"{self._base()}/episodes/<episode id>/v1", code="not_found")

    def _base(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{_url_host(host)}:{port}"

    # -- routes --------------------------------------------------------------
    def _chat(self, episode_id: str, body: Any) -> tuple[int, dict]:
        return 200, self.server.gateway.chat(episode_id, body)

    def _models(self, episode_id: Optional[str], body: Any) -> tuple[int, dict]:
        gw = self.server.gateway
        return 200, models_response(gw.config.model_name, gw.created)

    def _no_episode(self, episode_id: Any, body: Any) -> tuple[int, dict]:
        raise GatewayError(404, "chat completions are recorded per episode: point the client at "
                           f"base_url={self._base()}/episodes/<episode id>/v1", code="episode_required")

    def _open(self, episode_id: Any, body: Any) -> tuple[int, dict]:
        if not isinstance(body, dict):
            raise GatewayError(400, "the body must be a JSON object")
        extra = sorted(set(body) - {"id", "prompt_index", "metadata"})
        if extra:
            raise GatewayError(400, f"unknown field(s) {extra}; POST /episodes takes id, prompt_index, metadata",
                               param=extra[0])
        meta = body.get("metadata")
        if meta is not None and not isinstance(meta, dict):
            raise GatewayError(400, "metadata must be a JSON object", param="metadata")
        eid = self.server.gateway.open_episode(body.get("id"), prompt_index=body.get("prompt_index"),
                                               metadata=meta)
        return 201, {"id": eid, "base_url": f"{self._base()}/episodes/{eid}/v1"}

    def _show(self, episode_id: str, body: Any) -> tuple[int, dict]:
        return 200, self.server.gateway.episode(episode_id).summary()

    def _reward(self, episode_id: str, body: Any) -> tuple[int, dict]:
        if not isinstance(body, dict) or "reward" not in body:
            raise GatewayError(400, 'the body must be {"reward": <number>}', param="reward")
        self.server.gateway.set_reward(episode_id, body["reward"])
        return 200, {"id": episode_id, "reward": float(body["reward"])}

    def _finish(self, episode_id: str, body: Any) -> tuple[int, dict]:
        if not isinstance(body, dict):
            raise GatewayError(400, 'the body must be a JSON object ({} or {"reward": <number>})')
        self.server.gateway.finish(episode_id, body.get("reward"))
        return 200, {"id": episode_id, "finished": True}

    def _next_task(self, episode_id: Any, body: Any) -> tuple[int, dict]:
        wait = body.get("wait", 10.0) if isinstance(body, dict) else None
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= _MAX_TASK_WAIT_S:
            raise GatewayError(400, f"wait={wait!r} must be a number of seconds in [0, {_MAX_TASK_WAIT_S}]",
                               param="wait")
        task = self.server.gateway.next_task(float(wait))
        if task is None:
            return 200, {"episode_id": None}
        return 200, {**task, "base_url": f"{self._base()}/episodes/{task['episode_id']}/v1"}

    def _health(self, episode_id: Any, body: Any) -> tuple[int, dict]:
        return 200, {"status": "ok"}


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class GatewayServer:
    """The gateway's HTTP server, serving on a thread of its own; a context manager.

    ``url``: ``http://host:port``; ``base_url(episode_id)``: what an agent's openai client
    takes as ``base_url``; ``httpd.stats``: connections open now, connections refused at the
    cap, body bytes read.
    """

    def __init__(self, gateway: Any, host: str = "127.0.0.1", port: int = 0):
        """``gateway``: the :class:`~grpo_mega.gateway.core.Gateway` to serve (not imported
        here: ``Gateway.serve`` builds this class)."""
        self.gateway = gateway
        self.httpd = _Server((host, port), _Handler, gateway)
        self.host, self.port = self.httpd.server_address[:2]
        if not is_loopback(host):
            log.warning("gateway: listening on %s:%d, which is NOT a loopback address: anyone who can reach "
                        "it can run the model and write training data%s", host, self.port,
                        "" if gateway.config.api_key else " (and no api_key is set: GatewayConfig.api_key)")
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="gateway-http", daemon=True)
        self._thread.start()
        log.info("gateway: serving on %s (an agent's base_url: %s)", self.url, self.base_url("<episode id>"))

    @property
    def url(self) -> str:
        return f"http://{_url_host(self.host)}:{self.port}"

    def base_url(self, episode_id: str) -> str:
        return f"{self.url}/episodes/{episode_id}/v1"

    def close(self) -> None:
        """Stop serving and the gateway's engine thread."""
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join()
        self.gateway.close()

    def __enter__(self) -> "GatewayServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
