"""Session-wide leak check: no test may leave a process or a /dev/shm segment behind.

Tests launch torchrun jobs, spawned ranks, vLLM engines and reward workers, and several
kill them on purpose. Leftovers were found 25 minutes after their tests ended (a
``launch_collective.py`` rank and a ``multiprocessing`` child), and a killed engine's
shared-memory segments broke every later TP=2 engine on the machine. So:

* every process started during the session inherits ``GRPO_MEGA_TEST_SESSION``; any such
  process still alive when the session ends (after a grace period) is killed, listed,
  and fails the run;
* every file in /dev/shm created during the session that no live process maps or holds
  open (``rollout.cpu_shm.stale_segments``) is removed, listed, and fails the run: vLLM's
  CPU segments of this session's engines (named after its tag, ``GRPO_MEGA_SHM_TAG``; other
  jobs' are not ours), vLLM's ``psm_*`` message queues, weight files.

``GRPO_MEGA_LEAK_CHECK=0`` turns it off (for a single test under a debugger).
"""
from __future__ import annotations

import os
import sys
import time
import uuid

import pytest

MARKER = "GRPO_MEGA_TEST_SESSION"
_SESSION = uuid.uuid4().hex  # fresh even inside another session: it must not check its parent
os.environ[MARKER] = _SESSION
os.environ["GRPO_MEGA_SHM_TAG"] = _SESSION[:6]  # this session's engines name their segments so
_SHM_BEFORE = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
# On CPU, vLLM's sampler keeps ``@torch.compile`` helpers (``gather_logprobs``) that
# ``enforce_eager`` does not turn off: every process that starts an engine traced and loaded
# them again (dynamo, inductor's cache, ISA checks in g++ subprocesses), about 4 of the 25
# CPU-seconds of a two-step demo run (measured 2026-11-28). With dynamo off, every test
# process and its children (ranks, engines) run them eagerly: the same held-out accuracy on
# the demo run; the compiled path is vLLM's own. GPU machines keep it; so does
# TORCHDYNAMO_DISABLE=0 set before pytest.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
# vLLM's usage-stats thread reads the CPU's features (cpuinfo, about 0.3 CPU-s per engine) and
# would try the network: no test engine reports usage.
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
GRACE_S = float(os.environ.get("GRPO_MEGA_LEAK_GRACE_S", "15"))
"""How long leftovers get to exit on their own (ranks and engines take a few seconds)."""


def _session_processes() -> list:
    import psutil

    me = os.getpid()
    mine = []
    for p in psutil.process_iter(["pid"]):
        if p.pid == me:
            continue
        try:
            if p.environ().get(MARKER) != _SESSION:
                continue
            if p.ppid() == me and "multiprocessing.resource_tracker" in " ".join(p.cmdline()):
                continue  # pytest's own helper; it exits with pytest
            mine.append(p)
        except (psutil.Error, OSError):
            continue
    return mine


def _describe(p) -> str:
    try:
        return f"pid {p.pid}: {' '.join(p.cmdline())[:200]}"
    except Exception:  # noqa: BLE001 - it exited meanwhile
        return f"pid {p.pid}"


def leftovers(grace_s: float = GRACE_S) -> tuple[list[str], list[str]]:
    """(processes of this session still alive after ``grace_s``, killed now; stale vLLM
    segments created during the session, removed now)."""
    import psutil

    from grpo_mega.rollout import cpu_shm

    deadline = time.time() + grace_s
    procs = _session_processes()
    while procs and time.time() < deadline:
        time.sleep(0.5)
        procs = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    lines = [_describe(p) for p in procs]
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    # Our vLLM segments by this session's tag (not other jobs' on a shared machine); any
    # other file new since the session started (vLLM's psm_* queues, weight files) by age.
    # POSIX semaphores (sem.*) are left out: glibc maps them under a temporary name, so no
    # process ever shows them in /proc/*/maps, and removing them broke other sessions' live
    # multiprocessing queues on a shared machine (SemLock._rebuild FileNotFoundError).
    ours = f"{cpu_shm.PREFIX}{_SESSION[:6]}"
    shm = cpu_shm.stale_segments(match=lambda n: n not in _SHM_BEFORE and not n.startswith("sem.") and (
        n.startswith(ours) or not n.startswith(cpu_shm.PREFIX)))
    for s in shm:
        s.unlink(missing_ok=True)
    return lines, [s.name for s in shm]


SLOW_FIRST = ("tests/integration/test_layouts.py", "tests/integration/test_demo.py",
              "tests/integration/test_faults.py", "tests/integration/test_scale_configs.py",
              "tests/integration/test_train.py", "tests/integration/test_async.py",
              "tests/integration/test_kill.py", "tests/integration/test_layout_invariance.py",
              "tests/integration/test_layouts_multi_turn.py", "tests/integration/test_launch.py",
              "tests/integration/test_gateway_train.py", "tests/integration/test_console.py",
              "tests/unit/optim/test_distributed_optimizer.py", "tests/unit/models/test_parallel_models.py",
              "tests/unit/checkpoint/test_convert.py", "tests/unit/rollout/test_remote_engine.py",
              "tests/unit/rollout/test_engine.py")
"""Files by measured cost, most first (2-4 minutes each down to one): ``make test`` runs the
suite on two workers (pytest-xdist, one file per unit, ``--no-loadscope-reorder``), and
starting the longest files first keeps one worker from finishing them alone at the end
(longest-processing-time-first). The remaining files keep pytest's order."""


def pytest_collection_modifyitems(session, config, items):
    rank = {f: i for i, f in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable


CPU_LOG = os.environ.get("GRPO_MEGA_TEST_CPU")
"""A file to append each test's CPU seconds to (JSON lines: id, cpu_s, wall_s, end: the
Unix time it ended, worker: the xdist worker; setup and teardown included, its waited-for
subprocesses too: a SIGKILLed one's are not). Wall time on two shared cores says
little about what a test costs; this is the budget's unit. Off unless set."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not CPU_LOG:
        yield
        return
    import json
    import time

    from tests.distributed import RANK_CPU_S, process_cpu_s  # RANK_CPU_S: the fork server's ranks

    def cpu() -> float:
        return process_cpu_s() + RANK_CPU_S[0]

    c0, t0 = cpu(), time.monotonic()
    yield
    row = {"id": item.nodeid, "cpu_s": round(cpu() - c0, 2), "wall_s": round(time.monotonic() - t0, 2),
           "end": round(time.time(), 1), "worker": os.environ.get("PYTEST_XDIST_WORKER", "")}
    with open(CPU_LOG, "a") as f:
        f.write(json.dumps(row) + "\n")


def pytest_sessionfinish(session, exitstatus):
    if "tests.distributed" in sys.modules:  # run_ranks' fork server: stopped, not leaked
        sys.modules["tests.distributed"].stop_fork_server()
    if os.environ.get("GRPO_MEGA_LEAK_CHECK", "1") == "0" or os.environ.get(MARKER) != _SESSION:
        return
    procs, shm = leftovers()
    if not (procs or shm):
        return
    print("\n[leak check] the tests left these behind (now killed / removed):", file=sys.stderr)
    for line in procs:
        print(f"[leak check]   process {line}", file=sys.stderr)
    for name in shm:
        print(f"[leak check]   /dev/shm/{name}", file=sys.stderr)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
