"""The test harness's rank launcher (tests/distributed.py)."""
from __future__ import annotations

import socket

from tests import distributed as D


def _rank_answer(rank, world):
    return rank + 40


def test_run_ranks_relaunches_when_rank_0_finds_its_port_taken(monkeypatch, capsys):
    """Guards against a suite flake seen under pytest-xdist: the free port ``run_ranks`` picked
    was taken by another worker's launch before rank 0 bound it (EADDRINUSE in
    ``init_process_group``), failing a test that had not started. The launcher must relaunch
    on a new port, and say so."""
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    ports = iter([busy.getsockname()[1]])
    real = D.free_port
    monkeypatch.setattr(D, "free_port", lambda: next(ports, None) or real())
    try:
        assert D.run_ranks(1, _rank_answer, timeout=120) == [40]
    finally:
        busy.close()
    assert "port taken before rank 0 bound it (try 1 of 3)" in capsys.readouterr().out
