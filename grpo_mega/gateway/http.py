"""The HTTP server: routes, JSON in and out, OpenAI's error shape, loopback by default.

Built on the standard library's ``ThreadingHTTPServer`` rather than FastAPI/uvicorn: the
gateway runs inside the trainer's process next to the engine, and a thread per connection
with blocking calls into :class:`~grpo_mega.gateway.core.Gateway` needs no event loop, no
extra dependency (fastapi and uvicorn arrive only as vLLM's, in versions vLLM picks) and
starts in milliseconds. It speaks HTTP/1.1 with keep-alive (the openai client reuses its
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
``GET  /health``                             ``{"status": "ok"}``
==========================================  ===========================================

Every refusal is JSON in OpenAI's error shape with a 4xx status and the header
``x-should-retry: false`` (the openai client would otherwise retry a 409 twice); a failure
of the engine is a 5xx with the reason. No request can stop the server: an unexpected
exception in a handler is logged and answered 500.
"""
from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import re
import socket
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional
from urllib.parse import urlsplit

from grpo_mega.gateway.openai_api import GatewayError, error_body, models_response

__all__ = ["GatewayServer", "is_loopback"]

log = logging.getLogger(__name__)

_EP = r"/episodes/(?P<id>[^/]+)"
_ROUTES = [
    ("POST", re.compile(rf"^{_EP}/v1/chat/completions$"), "chat"),
    ("GET", re.compile(rf"^(?:{_EP})?/v1/models$"), "models"),
    ("POST", re.compile(r"^/v1/chat/completions$"), "no_episode"),
    ("POST", re.compile(r"^/episodes$"), "open"),
    ("GET", re.compile(rf"^{_EP}$"), "show"),
    ("POST", re.compile(rf"^{_EP}/reward$"), "reward"),
    ("POST", re.compile(rf"^{_EP}/finish$"), "finish"),
    ("GET", re.compile(r"^/health$"), "health"),
]


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is a loopback address."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address, handler, gateway: Any):
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.gateway = gateway
        super().__init__(address, handler)

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
        # The stdlib's own refusals (a malformed request line, an unsupported method) in
        # OpenAI's JSON error shape too, rather than an HTML page.
        self.close_connection = True
        self._send(code, error_body(code, message or explain or HTTPStatus(code).phrase))

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("gateway %s - " + fmt, self.address_string(), *args)

    # -- plumbing ------------------------------------------------------------
    def _dispatch(self, method: str) -> None:
        try:
            raw = self._read_body()  # first, whatever the answer: on a kept-alive connection an
            status, payload = self._route(method, raw)  # unread body would be read as the next request
        except GatewayError as e:
            status, payload = e.status, e.body()
        except Exception as e:  # noqa: BLE001 - a handler bug answers 500, the server lives on
            log.exception("gateway: unexpected error on %s %s", method, self.path)
            status, payload = 500, error_body(500, f"internal error: {type(e).__name__}: {e}")
        self._send(status, payload)

    def _send(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if 400 <= status < 500:
            self.send_header("x-should-retry", "false")
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            self.close_connection = True
            raise GatewayError(411, "send the body with a Content-Length (chunked bodies are not read)")
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            self.close_connection = True
            raise GatewayError(400, "Content-Length is not a number") from None
        limit = self.server.gateway.config.max_body_bytes
        if length > limit:
            self.close_connection = True  # the body stays unread
            raise GatewayError(413, f"request body of {length} bytes exceeds {limit} "
                               "(GatewayConfig.max_body_bytes)")
        return self.rfile.read(length) if length > 0 else b""

    @staticmethod
    def _json(raw: bytes) -> Any:
        if not raw:
            return {}
        try:
            return json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
        except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as e:
            raise GatewayError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None

    def _authorized(self) -> None:
        key = self.server.gateway.config.api_key
        if key is None:
            return
        sent = self.headers.get("Authorization", "")
        if not hmac.compare_digest(sent.encode(), f"Bearer {key}".encode()):
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
            self._authorized()
            body = self._json(raw) if method == "POST" else None
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

    def _health(self, episode_id: Any, body: Any) -> tuple[int, dict]:
        return 200, {"status": "ok"}


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class GatewayServer:
    """The gateway's HTTP server, serving on a thread of its own; a context manager.

    ``url``: ``http://host:port``; ``base_url(episode_id)``: what an agent's openai client
    takes as ``base_url``.
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
