"""The tool sandbox (grpo_mega.envs.sandbox): each limit enforced on real model-like code.

Every test runs real code in the real confined child (namespaces, Landlock, seccomp,
rlimits); nothing is mocked. Each limit is checked by what the code can observe or
what it leaves behind, so dropping any one layer fails a named test (the catalogue in
tests/mutations.yaml makes each of those bugs on purpose). The whole file takes a few
seconds: most runs cost ~30 ms, the CPU and wall-clock ones about a second each.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest

from grpo_mega.envs.sandbox import Sandbox, SandboxConfig
from tests import REPO
from tests.unit.envs.sandbox_probe import needs_sandbox

pytestmark = needs_sandbox


def run(code: str, **limits):
    return Sandbox(SandboxConfig(**limits)).run(textwrap.dedent(code))


def test_tool_sandbox_runs_code_and_echoes_the_last_expression():
    """Guards against a sandbox that does not run code at all, or loses its output (the
    other tests would then pass on an empty output)."""
    r = run("print('hi')\n6 * 7")
    assert (r.stdout, r.exit_code, r.error) == ("hi\n42\n", 0, None), r
    assert r.text() == "hi\n42"


def test_tool_sandbox_error_is_a_short_traceback_of_the_code_only():
    """Guards against a crash of the code raising into the run, and against tracebacks
    full of the sandbox's own frames (noise in the model's context)."""
    r = run("x = 1\n1 / x * (1 / 0)")
    assert r.exit_code == 1 and r.error is None
    assert 'File "<tool>", line 2' in r.stderr and "ZeroDivisionError" in r.stderr
    assert "sandbox_child" not in r.stderr, r.stderr


def test_tool_sandbox_cpu_loop_is_killed_at_the_cpu_limit():
    """Guards against a missing RLIMIT_CPU: a busy loop then runs until the wall clock
    (or forever with a long one), holding a core the trainer needs."""
    r = run("while True: pass", cpu_seconds=1, wall_seconds=20)
    assert r.exit_code == 137 and r.error and "CPU time limit" in r.error, r
    assert r.seconds < 5, r.seconds
    assert "CPU time limit" in r.text()


def test_tool_sandbox_sleeping_code_is_killed_at_the_wall_clock():
    """Guards against a missing wall-clock deadline: code that sleeps (or blocks) uses no
    CPU, so only the deadline stops it."""
    r = run("import time\ntime.sleep(10)\nprint('woke')", wall_seconds=1)
    assert r.error and "wall-clock timeout" in r.error and "woke" not in r.stdout, r
    assert r.seconds < 4, r.seconds


def test_tool_sandbox_memory_bomb_fails_inside_the_code():
    """Guards against a missing RLIMIT_AS: a 300 MB allocation must fail in the code
    (MemoryError) under a 64 MB limit, not take the machine's memory."""
    r = run("x = bytearray(300 * 2**20)\nprint('allocated')", memory_mb=64)
    assert "MemoryError" in r.stderr and "allocated" not in r.stdout, r
    assert r.exit_code == 1


def test_tool_sandbox_output_flood_is_truncated_and_stopped():
    """Guards against unbounded output capture: a flood must be cut at the byte budget
    (and the code stopped), not read into the trainer's memory until a limit hits."""
    r = run("while True:\n    print('x' * 1000)", max_output_bytes=1500, wall_seconds=10)
    assert r.truncated and r.error and "output limit" in r.error, r
    assert len(r.stdout.encode()) + len(r.stderr.encode()) <= 1500
    assert r.seconds < 3, r.seconds
    assert r.text().endswith("[output truncated]\n[error: output limit (1500 bytes) reached, stopped]")


def test_tool_sandbox_has_no_network_udp_or_tcp():
    """Guards against a sandbox without a network namespace: a datagram to a UDP server
    this test runs on loopback must not arrive (Landlock does not cover UDP, so only the
    namespace stops it), and a TCP connect to a loopback server must fail."""
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        udp.bind(("127.0.0.1", 0))
        tcp.bind(("127.0.0.1", 0))
        tcp.listen(1)
        code = f"""
            import socket
            for kind, port in (("udp", {udp.getsockname()[1]}), ("tcp", {tcp.getsockname()[1]})):
                try:
                    if kind == "udp":
                        socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"leak", ("127.0.0.1", port))
                    else:
                        socket.create_connection(("127.0.0.1", port), timeout=1)
                    print(kind, "sent")
                except OSError as e:
                    print(kind, "refused", e.errno)
            """
        r = run(code)
        udp.settimeout(0.2)
        with pytest.raises(socket.timeout):
            udp.recvfrom(16)
        tcp.settimeout(0.2)
        with pytest.raises(socket.timeout):
            tcp.accept()
        assert "udp refused" in r.stdout and "tcp refused" in r.stdout, r
    finally:
        udp.close()
        tcp.close()


def test_tool_sandbox_writes_land_only_in_its_temp_dir_which_is_removed(tmp_path):
    """Guards against code writing (or reading) outside its temporary directory (no
    Landlock: the checkpoints, the data with the reference answers), and against the
    directory outliving the call."""
    secret = tmp_path / "answers.jsonl"
    secret.write_text("the reference answer\n")
    escape = tmp_path / "escaped.txt"
    code = f"""
        import os
        open("inside.txt", "w").write("ok")
        print(os.getcwd(), os.environ["TMPDIR"] == os.getcwd(), os.listdir("."))
        for what, path, mode in (("write", {str(escape)!r}, "w"), ("read", {str(secret)!r}, "r")):
            try:
                open(path, mode)
                print(what, "allowed")
            except PermissionError:
                print(what, "denied")
        """
    r = run(code)
    first = r.stdout.splitlines()[0].split(" ", 1)
    cwd = first[0]
    assert os.path.basename(cwd).startswith("grpo-sandbox-") and first[1] == "True ['inside.txt']", r
    assert "write denied" in r.stdout and "read denied" in r.stdout, r
    assert not escape.exists()
    assert not os.path.exists(cwd), f"the sandbox directory {cwd} was left behind"


def test_tool_sandbox_environment_is_minimal_and_stdin_is_devnull(monkeypatch):
    """Guards against inherited environment variables (API keys, tokens, cluster
    credentials of the trainer's environment reach the model) and an open stdin."""
    monkeypatch.setenv("GRPO_TEST_SECRET_TOKEN", "hunter2")
    r = run("""
        import json, os, stat
        st = os.fstat(0)
        print(json.dumps(sorted(os.environ)), stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3))
        """)
    names, devnull = r.stdout.rsplit(" ", 1)
    assert json.loads(names) == ["HOME", "LANG", "LC_ALL", "PATH", "TMPDIR"], r
    assert devnull.strip() == "True", r
    assert "hunter2" not in r.stdout


def test_tool_sandbox_refuses_new_processes_but_allows_threads():
    """Guards against a sandbox where the code can fork (a fork bomb; a root trainer is
    exempt from RLIMIT_NPROC, so only the seccomp filter stops it), and against a filter
    so broad that threads fail too."""
    r = run("""
        import os, threading
        out = []
        t = threading.Thread(target=out.append, args=("thread ran",))
        t.start(); t.join()
        print(out[0])
        try:
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            print("forked")
        except BlockingIOError:
            print("fork refused")
        """)
    assert r.stdout.splitlines() == ["thread ran", "fork refused"], r


def test_tool_sandbox_background_processes_die_with_the_call():
    """Guards against a sandbox without a PID namespace: a process the code leaves behind
    (holding the output pipe) would keep running after the call and stall it until the
    wall clock. The code is PID 1 of its namespace; when it exits, the rest dies."""
    r = run("""
        import os, time
        print(os.getpid(), flush=True)
        if os.fork() == 0:
            time.sleep(30)
        """, allow_subprocesses=True, wall_seconds=8)
    assert r.stdout.split() == ["1"] and r.error is None, r
    assert r.seconds < 3, r.seconds


_NO_USERNS = r"""
import logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="LOG %(message)s")
from grpo_mega.envs.sandbox import Sandbox, SandboxUnavailable
try:
    Sandbox().check()
    print("CHECKED")
except SandboxUnavailable as e:
    print("UNAVAILABLE", e)
r = Sandbox().run("print('ran')")
print("RUN", r.unbuilt is not None, r.text())
code = "print('opted out')\ntry:\n    open('/etc/passwd')\nexcept PermissionError:\n    print('still confined')"
print(Sandbox({"unsafe_no_netns": True}).run(code).text())
"""


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_tool_sandbox_fails_closed_without_a_network_namespace():
    """Guards against a sandbox that quietly runs code with the host's network when no
    namespace can be made: ``check`` must raise naming the opt-out flag, ``run`` must not
    run the code (and not raise either), and the opt-out must work, be logged, and keep
    the other layers (Landlock). Made
    real by running in a user namespace that may create no nested ones."""
    probe = subprocess.run(["unshare", "-r", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("cannot make the outer user namespace here")
    script = "echo 0 > /proc/sys/user/max_user_namespaces && exec \"$0\" -c \"$1\""
    r = subprocess.run(["unshare", "-r", "sh", "-c", script, sys.executable, _NO_USERNS], capture_output=True,
                       text=True, timeout=60, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [line for line in r.stdout.splitlines()
             if not line.startswith(("LOG cannot build", "LOG sandbox: the trainer is root"))]
    assert lines[0].startswith("UNAVAILABLE") and "sandbox.unsafe_no_netns=true" in lines[0], r.stdout
    assert lines[1] == "RUN True [error: the sandbox is unavailable, the code was not run]", r.stdout
    assert any(line.startswith("LOG") and "host's network" in line for line in lines[2:]), r.stdout
    assert lines[-2:] == ["opted out", "still confined"], r.stdout


def test_tool_sandbox_calls_from_threads_are_independent():
    """Guards against state shared between concurrent calls (episodes run side by side):
    one temporary directory or output buffer for two calls would mix their files and
    outputs."""
    from concurrent.futures import ThreadPoolExecutor

    sandbox = Sandbox()
    code = "import os\nopen('mine.txt', 'w').write('{i}')\nprint({i}, os.listdir('.'), open('mine.txt').read())"
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: sandbox.run(code.format(i=i)), range(8)))
    assert [r.stdout for r in results] == [f"{i} ['mine.txt'] {i}\n" for i in range(8)], results
