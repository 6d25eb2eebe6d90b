"""The controller's handle on E engine servers (``rollout.placement: separate``).

:class:`RemoteEngines` lives only on the trainer's global rank 0 (:func:`remote_engines`
gives every other rank a :class:`NoEngine`, ``holds_engine = False``, which the weight
bridge skips). It is both

* a ``RolloutEngineProtocol`` engine for the weight bridge and a synchronous trainer:
  ``update_weights(bucket)`` broadcasts a bucket to every engine over the weights group,
  ``reset_prefix_cache()`` commits the update (the engines take the new policy version and
  resume), ``probe(specs)`` returns every engine's readings, each tagged with its engine, so
  the bridge's verification checks every engine; ``generate`` = submit + collect;
  ``release``/``resume``/``wake_*`` are no-ops (the engines never share a device with
  training);
* the asynchronous API: ``submit(prompts, sampling, step=..) -> ticket`` splits the prompts
  over the engines (contiguous slices; seeds follow each prompt's index in the submitted
  batch, so the split changes no sample), ``done(ticket)``, ``collect(ticket, timeout_s)``
  returns the ``RolloutBatch`` with per-token ``versions``; ``version`` is the last
  committed version; ``stats()`` every engine's counters and update timings.

Liveness: each engine's control connection is read by a daemon thread; every call waits
with a deadline and checks the engine's process, so a dead or hung engine fails the call
with :class:`RemoteEngineError` naming the engine, its pid and what it was doing, e.g.
``engine 1 (pid 4242) died while generating step 7: exit code -9``. No call blocks forever:
the weights broadcast has the group's timeout (``timeout_s``).
"""
from __future__ import annotations

import itertools
import os
import subprocess
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Listener
from typing import Any, Iterable, Mapping, Sequence

import torch

from grpo_mega.rollout.remote import wire
from grpo_mega.rollout.remote.launch import RemoteEngineError, accept, spawn
from grpo_mega.rollout.types import EngineConfig, RolloutBatch, SamplingConfig, logprobs_mode_for

__all__ = ["RemoteEngines", "NoEngine", "remote_engines", "RemoteEngineError"]


@dataclass
class _Engine:
    index: int
    conn: Any
    pid: int
    proc: Any = None
    """The Popen of a server we spawned (None: started elsewhere)."""
    replies: dict = field(default_factory=dict)
    results: dict = field(default_factory=dict)
    error: str | None = None
    closed: bool = False
    send_lock: Any = field(default_factory=threading.Lock)
    """A trainer may sync weights in one thread while another collects samples: a message's
    bytes must not interleave with another's."""


@dataclass
class _Ticket:
    parts: list[tuple[int, str]]
    """(engine, its part's ticket id) in prompt order."""
    step: int
    empty: RolloutBatch


class RemoteEngines:
    """E engine servers driven from this process (see the module docstring).

    Args:
        engine: how each server builds its vLLM engine (``mode`` is forced to in-process
            there, prefix caching off).
        sampling: default sampling (its temperature also picks the logprobs mode).
        engines: number of servers E.
        devices: GPU: CUDA ids per engine (``rollout.engine_devices`` split in E groups).
        cores: CPU: core ids per engine (pinned before vLLM starts; torch threads = count).
        host: interface of the control listener and the weights store (loopback default;
            the node's address when servers run on other nodes).
        version: the policy version the engines' initial weights carry.
        timeout_s: deadline of every call's answers and of the weights group's collectives.
        startup_timeout_s: deadline for every server to connect and build its engine.
        launch: spawn the servers here; False: wait for servers started elsewhere with
            ``launch.server_command`` and this object's ``authkey`` (printed address:
            ``address``).
    """

    holds_engine = True
    dp_size, dp_rank, replica_group, replica_leader, lockstep = 1, 0, None, 0, False

    def __init__(self, engine: EngineConfig, sampling: SamplingConfig | None = None, *,
                 engines: int = 1, devices: Sequence[Sequence[int]] = (),
                 cores: Sequence[Sequence[int]] = (), host: str = "127.0.0.1", version: int = 0,
                 timeout_s: float = 120.0, startup_timeout_s: float = 600.0, launch: bool = True):
        if engines < 1:
            raise ValueError(f"rollout.engines={engines}; need at least 1")
        for name, per in (("devices", devices), ("cores", cores)):
            if per and len(per) != engines:
                raise ValueError(f"{name} lists {len(per)} groups for {engines} engines "
                                 "(rollout.engine_devices: engines x tp ids)")
        self.sampling = sampling or SamplingConfig()
        self.logprobs_mode = engine.logprobs_mode or logprobs_mode_for(self.sampling)
        self.count, self.timeout_s, self.version = engines, timeout_s, version
        self.next_version: int | None = None
        """The version the next commit gives (None: ``version + 1``); the trainer sets it to
        its optimizer step count before a sync."""
        self.backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.device = (torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl"
                       else torch.device("cpu"))
        self.authkey = os.urandom(32).hex()
        self._cond = threading.Condition()
        self._ids = itertools.count()
        self._tickets: dict[int, _Ticket] = {}
        self._doing = {k: "starting" for k in range(engines)}
        self.updates: list[dict] = []
        self._update_start: float | None = None
        self._listener = Listener((host, 0), authkey=bytes.fromhex(self.authkey))
        self.address = self._listener.address
        procs = self._procs = {}
        if launch:
            procs = self._procs = {k: spawn(self.address, self.authkey, k, cores=cores[k] if cores else (),
                              devices=devices[k] if devices else ()) for k in range(engines)}
        self.engines: list[_Engine] = []
        try:
            hellos = accept(self._listener, engines, procs, startup_timeout_s)
            self.engines = [_Engine(k, conn, pid, procs.get(k)) for k, (conn, pid) in sorted(hellos.items())]
            self._store, self._pg = self._handshake(engine, host, startup_timeout_s)
            for e in self.engines:
                threading.Thread(target=self._read, args=(e,), name=f"grpo-engine-{e.index}",
                                 daemon=True).start()
            for e in self.engines:
                up = self._reply(e, "up", "starting its vLLM engine", startup_timeout_s)
                self.startup_seconds = max(getattr(self, "startup_seconds", 0.0), up["seconds"])
                self._doing[e.index] = "idle"
        except BaseException:
            self.close()
            raise

    def _handshake(self, engine: EngineConfig, host: str, timeout_s: float):
        """Send each server its configuration, then build our end of the weights group (rank
        0; returns once every server has joined it)."""
        store = wire.store(host, 0, self.count + 1, self.timeout_s, is_master=True)
        for e in self.engines:
            wire.send(e.conn, {"op": "config", "engine": wire.engine_to_json(engine),
                               "sampling": wire.sampling_to_json(self.sampling),
                               "store": [host, store.port], "world": self.count + 1,
                               "backend": self.backend, "timeout_s": self.timeout_s,
                               "version": self.version})
        try:
            pg = wire.weights_group(store, host, 0, self.count + 1, self.backend, self.timeout_s)
        except RuntimeError as err:
            raise RemoteEngineError(f"engines did not join the weights group within "
                                    f"{self.timeout_s:.0f} s: {err}; {self._deaths()}") from err
        return store, pg

    # -- reading and waiting -------------------------------------------------
    def _read(self, e: _Engine) -> None:
        """The engine's messages, filed by kind; EOF marks it closed."""
        while True:
            try:
                msg = wire.recv(e.conn)
            except (EOFError, OSError, ValueError):
                with self._cond:
                    e.closed = True
                    self._cond.notify_all()
                return
            with self._cond:
                if msg["op"] == "result":
                    e.results[msg["ticket"]] = msg["batch"]
                elif msg["op"] == "error":
                    e.error = msg["message"] + "\n" + msg.get("traceback", "")
                else:
                    e.replies[msg.get("id", msg["op"])] = msg
                self._cond.notify_all()

    def _deaths(self) -> str:
        gone = [f"engine {e.index} (pid {e.pid}) exit code {e.proc.poll()}" for e in self.engines
                if e.proc is not None and e.proc.poll() is not None]
        return "; ".join(gone) or "no engine process has exited"

    def _check(self, e: _Engine, what: str) -> None:
        """Raise RemoteEngineError if engine ``e`` is dead or failed (called under the lock)."""
        rc = e.proc.poll() if e.proc is not None else None
        if e.error is None and not e.closed and rc is None:
            return
        if rc is None and e.proc is not None:
            try:  # the connection closes a moment before the exit status is there
                rc = e.proc.wait(2.0)
            except subprocess.TimeoutExpired:
                pass
        how = f"exit code {rc}" if rc is not None else "its connection closed"
        if e.error:
            how += f"; it reported: {e.error.strip()}"
        raise RemoteEngineError(f"engine {e.index} (pid {e.pid}) died while {what}: {how}")

    def _wait(self, e: _Engine, ready, what: str, timeout_s: float | None, *, quiet: bool = False):
        """``ready()``'s first non-None value; raises if ``e`` dies meanwhile, or when
        ``timeout_s`` (default: the engines' timeout) passes (``quiet``: returns None then)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                got = ready()
                if got is not None:
                    return got
                self._check(e, what)
                left = deadline - time.monotonic()
                if left <= 0:
                    if quiet:
                        return None
                    raise RemoteEngineError(f"engine {e.index} (pid {e.pid}) gave no answer within "
                                            f"{timeout_s:.0f} s while {what}")
                self._cond.wait(min(left, 0.2))

    def _reply(self, e: _Engine, key, what: str, timeout_s: float | None = None) -> dict:
        return self._wait(e, lambda: e.replies.pop(key, None), what, timeout_s)

    def _request(self, e: _Engine, op: str, what: str, timeout_s: float | None = None, **body) -> dict:
        """Send ``op`` to engine ``e`` alone and return its reply."""
        key = next(self._ids)
        self._send(e, dict(body, op=op, id=key), what)
        return self._reply(e, key, what, timeout_s)

    def _call(self, op: str, what: str, timeout_s: float | None = None, **body) -> list[dict]:
        """Send ``op`` to every engine and return their replies, in engine order."""
        key = next(self._ids)
        for e in self.engines:
            self._send(e, dict(body, op=op, id=key), what)
        return [self._reply(e, key, what, timeout_s) for e in self.engines]

    def _send(self, e: _Engine, msg: dict, what: str) -> None:
        try:
            with e.send_lock:
                wire.send(e.conn, msg)
        except OSError:
            with self._cond:
                e.closed = True
                self._check(e, what)

    # -- asynchronous generation ------------------------------------------------
    def submit(self, prompts: Sequence[Any], sampling: SamplingConfig | None = None, *, step: int,
               keys: Sequence[int] | None = None, budgets: Sequence[int] | None = None,
               prompt_offset: int = 0, engine: int | None = None) -> int:
        """Queue ``n`` samples of each prompt (token id lists or objects with ``token_ids``)
        on the engines; returns a ticket for :meth:`done` / :meth:`collect`. ``keys``: per-prompt
        seed indices (default ``prompt_offset + i``), ``budgets``: per-prompt max_new_tokens;
        ``engine``: all on that engine (``engine % E``; a multi-turn episode's turns, one
        request each, spread over the engines by episode instead of all going to the last)."""
        s = sampling or self.sampling
        ids = [list(getattr(p, "token_ids", p)) for p in prompts]
        keys = [prompt_offset + i for i in range(len(ids))] if keys is None else list(keys)
        ticket = next(self._ids)
        parts = []
        bounds = [len(ids) * k // self.count for k in range(self.count + 1)]
        if engine is not None:
            bounds = [0] * (engine % self.count + 1) + [len(ids)] * (self.count - engine % self.count)
        for e in self.engines:
            lo, hi = bounds[e.index], bounds[e.index + 1]
            if lo == hi:
                continue
            part = f"t{ticket}.{e.index}"
            self._send(e, {"op": "generate", "ticket": part, "prompts": ids[lo:hi],
                           "sampling": wire.sampling_to_json(s), "step": step,
                           "offset": prompt_offset + lo, "keys": keys[lo:hi],
                           "budgets": None if budgets is None else list(budgets[lo:hi])},
                       f"receiving step {step}")
            parts.append((e.index, part))
        empty = RolloutBatch([], [], [], [], [], group_size=s.n, logprobs_mode=self.logprobs_mode)
        self._tickets[ticket] = _Ticket(parts, step, empty)
        return ticket

    def done(self, ticket: int) -> bool:
        """Whether every engine has returned its part (raises if one of them died)."""
        t = self._tickets[ticket]
        with self._cond:
            for k, part in t.parts:
                if part not in self.engines[k].results:
                    self._check(self.engines[k], f"generating step {t.step}")
                    return False
        return True

    def wait_any(self, tickets: Sequence[int], timeout_s: float) -> list[int]:
        """Those of ``tickets`` that are done, waiting up to ``timeout_s`` for one (raises if
        an engine they wait on died)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:  # reentrant: ``done`` takes it again
            while True:
                ready = [t for t in tickets if self.done(t)]
                left = deadline - time.monotonic()
                if ready or left <= 0:
                    return ready
                self._cond.wait(min(left, 0.2))

    def collect(self, ticket: int, timeout_s: float | None = None) -> RolloutBatch:
        """The ticket's samples (group-major, prompts in submitted order, ``versions`` per
        token). Waits at most ``timeout_s`` (None: as long as the engines are alive: an
        engine that does not answer a ping between two steps within the engines' timeout is
        taken as hung, and the call fails naming it)."""
        t = self._tickets[ticket]
        what = f"generating step {t.step}"
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        batches = []
        for k, part in t.parts:
            e = self.engines[k]
            while True:
                left = self.timeout_s if deadline is None else min(self.timeout_s, deadline - time.monotonic())
                d = self._wait(e, lambda: e.results.pop(part, None), what, max(left, 0.0), quiet=True)
                if d is not None:
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    raise RemoteEngineError(f"engine {e.index} (pid {e.pid}) did not finish within "
                                            f"{timeout_s:.0f} s while {what}")
                # alive between steps? (raises if not) Within the caller's deadline too: the
                # ranks waiting on this collect time out after it (trainer.pipeline).
                ping = None if deadline is None else max(min(self.timeout_s, deadline - time.monotonic()), 0.1)
                self._request(e, "stats", what, ping)
            batches.append(RolloutBatch.from_dict(d))
        del self._tickets[ticket]
        return RolloutBatch.concat(batches) if batches else t.empty

    def generate(self, prompts: Sequence[Any], sampling: SamplingConfig | None = None, *,
                 step: int | None = None, keys: Sequence[int] | None = None,
                 budgets: Sequence[int] | None = None, prompt_offset: int = 0,
                 progress: bool = False) -> RolloutBatch:
        """Synchronous ``submit`` + ``collect`` (``RolloutEngine.generate``'s signature)."""
        if step is None:
            step = self._step = getattr(self, "_step", -1) + 1
        return self.collect(self.submit(prompts, sampling, step=step, keys=keys, budgets=budgets,
                                        prompt_offset=prompt_offset))

    def generate_resharded(self, global_prompts: Sequence[Any], sampling: SamplingConfig | None = None,
                           *, step: int | None = None, to_rank: int = 0, to_size: int = 1,
                           progress: bool = False, mini_batches: int = 1) -> RolloutBatch:
        """Slice ``to_rank`` of ``to_size`` of the samples; only for a trainer of one process
        (a larger world needs rank 0 to hand the other ranks their slices: the trainer's job)."""
        from grpo_mega.rollout.layout import prompt_slice

        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            raise NotImplementedError("RemoteEngines.generate_resharded inside a world > 1: "
                                      "collect on rank 0 and scatter the slices in the trainer")
        batch = self.generate(global_prompts, sampling, step=step)
        return prompt_slice(batch, len(global_prompts), to_rank, to_size, mini_batches)

    # -- weights (RolloutEngineProtocol) --------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
                       ) -> float:
        """Broadcast one bucket to every engine; each pauses (requests kept) and loads it in
        place. Returns the seconds until the last byte left. Call :meth:`reset_prefix_cache`
        (or :meth:`commit`) after the last bucket."""
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        start = time.perf_counter()
        if self._update_start is None:
            self._update_start = start
        header, flats = wire.pack_bucket(items, self.device)
        what = f"loading weights for version {self._pending()}"
        self._call("weights", what, tensors=header)  # every engine paused and ready to receive
        try:
            for flat in flats:
                wire.broadcast(self._pg, flat)
        except RuntimeError as err:
            raise RemoteEngineError(f"weights broadcast failed ({err}); {self._deaths()}") from err
        return time.perf_counter() - start

    def _pending(self) -> int:
        return self.version + 1 if self.next_version is None else self.next_version

    def commit(self, version: int | None = None) -> list[dict]:
        """End an update: every engine drops cached KV, takes ``version`` (default
        :attr:`next_version`, else ``version + 1``) and resumes; returns each engine's
        update timings (``paused_s``, ``transfer_s``, ``load_s``, ``bytes``, ``buckets``)."""
        version = self._pending() if version is None else version
        replies = self._call("commit", f"committing version {version}", version=version)
        self.version, self.next_version = version, None
        seconds = time.perf_counter() - self._update_start if self._update_start else 0.0
        self._update_start = None
        self.updates.append({"version": version, "controller_s": seconds,
                             "engines": [r["update"] for r in replies]})
        return [r["update"] for r in replies]

    def reset_prefix_cache(self) -> None:
        """The bridge's "last bucket is in": commits the update (see :meth:`commit`)."""
        self.commit()

    def probe(self, specs: Sequence[Any], timeout_s: float | None = None) -> list[dict]:
        """Every engine's readings (``worker.probe_weights``), each reading's ``via`` naming its
        engine; a tensor an engine did not report gets an error reading, so verification fails
        if any one engine lacks it."""
        names = [s[0] for s in specs]
        out = []
        replies = self._call("probe", "probing its weights", timeout_s, specs=[list(s) for s in specs])
        for e, reply in zip(self.engines, replies):
            seen = set()
            for res in reply["result"]:
                for name, readings in res["probes"].items():
                    seen.add(name)
                    for r in readings:
                        r["via"] = f"engine {e.index}" + (f", {r['via']}" if r.get("via") else "")
                out.append(res)
            missing = {n: [{"error": f"engine {e.index} did not report it"}] for n in names if n not in seen}
            if missing:
                out.append({"dtype": "float32", "probes": missing})
        return out

    def release(self) -> None:
        """No-op: the engines never share a device with training."""

    resume = wake_weights = wake_kv_cache = release

    # -- bookkeeping ----------------------------------------------------------------
    def stats(self, timeout_s: float | None = None) -> dict:
        """{"version", "engines": [each server's counters and per-update timings],
        "updates": [controller-side update records]}."""
        per = [r["stats"] for r in self._call("stats", "reporting its stats", timeout_s)]
        return {"version": self.version, "engines": per, "updates": list(self.updates)}

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask every server to exit, kill those we spawned that do not within ``timeout_s``
        (idempotent; also after a failed start)."""
        for e in self.engines:
            try:
                with e.send_lock:
                    wire.send(e.conn, {"op": "close"})
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        for proc in self._procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:  # it hangs: kill it
                proc.kill()
                proc.wait()
        for e in self.engines:
            e.conn.close()
        self._listener.close()
        self.engines, self._procs = [], {}

    shutdown = close

    def __enter__(self) -> "RemoteEngines":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class NoEngine:
    """What a trainer rank other than global rank 0 holds under ``placement: separate``: the
    bridge skips it (``holds_engine`` False) and every weight call is a no-op."""

    holds_engine = False
    # The same layout facts as RemoteEngines: the trainer reads them on every rank.
    dp_size, dp_rank, replica_group, replica_leader, lockstep = 1, 0, None, 0, False
    next_version: int | None = None

    def __init__(self, sampling: SamplingConfig | None = None):
        self.sampling = sampling or SamplingConfig()

    def update_weights(self, named_tensors) -> float:
        return 0.0

    def reset_prefix_cache(self) -> None:
        pass

    def probe(self, specs) -> list[dict]:
        return []

    def release(self) -> None:
        pass

    resume = wake_weights = wake_kv_cache = close = shutdown = release


def remote_engines(rank: int, engine: EngineConfig, sampling: SamplingConfig | None = None,
                   **kwargs) -> RemoteEngines | NoEngine:
    """:class:`RemoteEngines` on global rank 0 (keyword arguments as its constructor's),
    :class:`NoEngine` elsewhere."""
    return RemoteEngines(engine, sampling, **kwargs) if rank == 0 else NoEngine(sampling)
