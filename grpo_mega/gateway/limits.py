"""The gateway's resource bounds: what clients can make the trainer's process hold.

The gateway runs inside the trainer's process, so whoever reaches it (every local user at
least; more where it listens beyond loopback) must not be able to grow that process, hold
its threads, or crash a request into a 500. What ``gateway.http`` guarantees with these
parts, each limit a field of :class:`~grpo_mega.gateway.config.GatewayConfig`:

* **Threads**: at most ``max_connections`` connection threads. The accepting thread answers
  one more connection 503 itself (:func:`refuse_connection`) and closes it; it gets no
  thread.
* **Time**: a connection waits at most ``idle_timeout_s`` for a request's first byte; from
  there the whole request (line, headers, body) must arrive within ``read_timeout_s``, one
  deadline for all of it (:class:`Deadlines`), so a client sending a byte now and then
  cannot renew a per-read timeout; a response must be taken within ``read_timeout_s`` too.
  A connection past its deadline is shut down and nothing of its request is processed.
* **Memory**: request line and headers at most ``max_header_bytes``
  (:class:`HeaderBudget`); a body at most ``max_body_bytes``, refused from its
  ``Content-Length`` before a byte of it is read, the read itself never taking more;
  chunked and other transfer codings are refused; at most ``max_total_body_bytes`` of
  bodies held over all connections at once (:class:`ByteBudget`). The API key is checked
  from the headers before the body is read, so a client without it never has its body
  read (at most what arrived in the same read buffer as its headers, 8 KiB).
* **Parsing** (:func:`parse_json_object`): bodies are UTF-8 JSON objects, nested at most
  ``max_json_depth`` deep, without lone UTF-16 surrogates; anything else is a 400.

Episodes are bounded in ``gateway.core`` (``max_open_episodes``). Not bounded here: the
kernel's socket buffers (the kernel's own limits) and the Python objects a parsed body
becomes (a small multiple of its bytes, each body at most ``max_body_bytes``).
"""
from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import time
from typing import Any

from grpo_mega.gateway.openai_api import GatewayError, error_body

__all__ = ["Deadlines", "ByteBudget", "HeaderBudget", "parse_json_object", "refuse_connection", "busy_response"]

_EXPIRED = -1.0
_SURROGATE = re.compile("[\ud800-\udfff]")


class Deadlines:
    """One thread that shuts down each socket whose deadline passed, waking the connection's
    thread from whatever read or write it is blocked in (a socket's own timeout restarts at
    every byte received, so it cannot bound a whole request)."""

    def __init__(self, tick_s: float = 0.05):
        self._due: dict[socket.socket, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.expired = 0
        """Connections shut down at their deadline (tests read it)."""
        self._tick = tick_s
        self._thread = threading.Thread(target=self._loop, name="gateway-deadlines", daemon=True)
        self._thread.start()

    def arm(self, sock: socket.socket, seconds: float) -> None:
        with self._lock:
            if self._due.get(sock) != _EXPIRED:
                self._due[sock] = time.monotonic() + seconds

    def disarm(self, sock: socket.socket) -> bool:
        """Stop the clock; False when the deadline had already passed (the socket is shut)."""
        with self._lock:
            return self._due.pop(sock, None) != _EXPIRED

    def forget(self, sock: socket.socket) -> None:
        """Before the socket is closed: under the lock, so that it is never shut after its
        descriptor was closed and reused by another connection."""
        with self._lock:
            self._due.pop(sock, None)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self._tick):
            now = time.monotonic()
            with self._lock:
                for sock, due in self._due.items():
                    if due != _EXPIRED and due <= now:
                        self._due[sock] = _EXPIRED  # stays until disarmed or forgotten
                        self.expired += 1
                        try:
                            sock.shutdown(socket.SHUT_RDWR)
                        except OSError:  # the client is gone already
                            pass


class ByteBudget:
    """A count of bytes held, refused above ``limit`` (thread-safe)."""

    def __init__(self, limit: int):
        self.limit, self.held = limit, 0
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if self.held + n > self.limit:
                return False
            self.held += n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self.held -= n


class HeaderBudget:
    """Stands in for a handler's ``rfile`` while the request line and headers are read: at
    most ``limit`` bytes in all (the standard library bounds each line at 64 KiB and the
    count at 100, which allows 6.5 MB). Over it: ``http.client.LineTooLong``, which the
    standard library's ``parse_request`` answers 431."""

    def __init__(self, fp: Any, limit: int):
        self.fp, self.limit, self.left = fp, limit, limit

    def readline(self, size: int = -1) -> bytes:
        cap = self.left + 1 if size is None or size < 0 else min(size, self.left + 1)
        line = self.fp.readline(cap)
        self.left -= len(line)
        if self.left < 0:
            raise http.client.LineTooLong(f"request line and headers over {self.limit} bytes "
                                          "(GatewayConfig.max_header_bytes)")
        return line

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fp, name)


def _bad(message: str) -> GatewayError:
    return GatewayError(400, message, code="invalid_json")


def parse_json_object(raw: bytes, max_depth: int) -> dict:
    """A request body as a JSON object (``{}`` when empty); 400 for anything else: not UTF-8,
    not JSON, NaN/Infinity, nested deeper than ``max_depth``, a lone surrogate, not an object."""
    if not raw:
        return {}
    try:
        value = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except RecursionError:  # the C parser's own limit, about 1000 levels
        raise _bad(f"the request body nests arrays/objects deeper than {max_depth} levels "
                   "(GatewayConfig.max_json_depth)") from None
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError is a ValueError
        raise _bad(f"the request body is not valid JSON: {e}") from None
    # Iterative on purpose: the checks must not recurse on what the client nested.
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            _text(v)
        elif isinstance(v, (dict, list)):
            if depth > max_depth:
                raise _bad(f"the request body nests arrays/objects deeper than {max_depth} levels "
                           "(GatewayConfig.max_json_depth)")
            if isinstance(v, dict):
                for key in v:
                    _text(key)
                v = v.values()
            stack.extend((x, depth + 1) for x in v)
    if not isinstance(value, dict):
        raise _bad(f"the request body must be a JSON object, not {type(value).__name__}")
    return value


def _text(s: str) -> None:
    # A JSON escape can encode half of a UTF-16 pair ("\ud800"): a str Python holds but no
    # UTF-8 encoder (tokenizer, template, log) accepts. Paired escapes decode to one code point.
    m = _SURROGATE.search(s)
    if m is not None:
        raise _bad(f"a string in the request body holds a lone UTF-16 surrogate (\\u{ord(m.group()):04x} at "
                   f"character {m.start()}), which is not text")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def busy_response(status: int, message: str, code: str) -> bytes:
    """A whole HTTP response that asks the client to retry (``Retry-After: 1``), then closes."""
    body = json.dumps(error_body(status, message, code=code)).encode()
    head = (f"HTTP/1.1 {status} {http.client.responses[status]}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nx-should-retry: true\r\nConnection: close\r\n\r\n")
    return head.encode() + body


def refuse_connection(sock: socket.socket, response: bytes) -> None:
    """Answer a connection over the cap from the accepting thread: never block it (a
    non-blocking send of a few hundred bytes into an empty buffer), then close."""
    try:
        sock.setblocking(False)
        sock.send(response)
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    sock.close()
