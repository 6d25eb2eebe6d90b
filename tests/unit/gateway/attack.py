"""A hostile load on a gateway, run as a child process by ``test_gateway_limits.py`` (its
sockets and threads then do not count in the server's /proc/self/status). Standard library
only, so it starts in a few tens of milliseconds.

    python tests/unit/gateway/attack.py HOST PORT HALF UPLOADS UPLOAD_BYTES OVERSIZED HOLD_S

* ``HALF`` half-sent requests: part of a header line, then nothing (finding 11's 190);
* ``UPLOADS`` clients without the API key, each sending a body of ``UPLOAD_BYTES`` over and
  over (finding 11's 40 uploads grew the trainer by 602 MiB), side by side;
* ``OVERSIZED`` clients with the key announcing a 1 GiB body over and over.

The uploaders retry at once when refused at the connection cap, for 3/4 of ``HOLD_S``.
Prints ``ready`` once the half-sent requests are connected; ``HOLD_S`` seconds later, one
JSON line: how each half-sent connection stands (``open``: still held by
the server, ``closed`` by it without an answer, ``503``..., ``reset``) and the answers the
other clients got (the status, ``closed``, ``reset``).
"""
from __future__ import annotations

import collections
import json
import select
import socket
import sys
import threading
import time


def _status(sock: socket.socket) -> str:
    """How the server ended this connection so far, without blocking."""
    try:
        r, _, _ = select.select([sock], [], [], 0)
        if not r:
            return "open"
        data = sock.recv(65536)
    except OSError:
        return "reset"
    if not data:
        return "closed"
    return data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/") else "garbage"


def _send(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:  # refused at the connection cap before the request went out
        pass


def _persist(host: str, port: int, request: bytes, until: float, out: list) -> None:
    """Send ``request`` again and again (refused at the cap: retry at once, as an attacker
    would) until ``until``; every answer's status goes to ``out``."""
    while time.monotonic() < until:
        try:
            sock = socket.create_connection((host, port), timeout=2)
        except OSError:
            out.append("connect_failed")
            continue
        with sock:
            _send(sock, request)  # the server may answer and close before the body is sent: expected
            try:
                data = sock.recv(65536)
                out.append(data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/") else "closed")
            except OSError:
                out.append("reset")
        time.sleep(0.01)


def main(host: str, port: int, half: int, uploads: int, upload_bytes: int, oversized: int, hold_s: float) -> None:
    start = time.monotonic()
    held = []
    for _ in range(half):
        s = socket.create_connection((host, port), timeout=5)
        _send(s, b"POST /episodes HTTP/1.1\r\nHost: x\r\nContent-Le")
        held.append(s)
    print("ready", flush=True)
    start = time.monotonic()  # the hold counts from here: connecting can take a while on a busy machine
    upload = (f"POST /episodes HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\n"
              f"Content-Length: {upload_bytes}\r\n\r\n").encode() + b" " * upload_bytes
    big = b"POST /episodes HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\nContent-Length: 1073741824\r\n\r\n"
    answers: dict[str, list] = {"uploads": [], "oversized": []}
    until = start + hold_s * 0.75
    threads = [threading.Thread(target=_persist, args=(host, port, req, until, answers[kind]))
               for kind, req, n in (("uploads", upload, uploads), ("oversized", big, oversized)) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(max(0.0, hold_s - (time.monotonic() - start)))
    report = {"half": collections.Counter(_status(s) for s in held),
              **{kind: collections.Counter(a) for kind, a in answers.items()}}
    print(json.dumps(report), flush=True)
    for s in held:
        s.close()


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], int(a[1]), int(a[2]), int(a[3]), int(a[4]), int(a[5]), float(a[6]))
