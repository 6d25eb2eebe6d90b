"""The tool sandbox against code that tries to reach the host (issue 38, findings 1-5).

Each test runs hostile code in the real confined child and then checks the host's state,
not a message: the outside file's mode, mtime, xattrs and size, whether a host Unix
socket saw a connection, whether any process of the call is left, what is left in the
temporary root. Cheap: a few sandbox runs of ~30 ms, one deep tree, one killed trainer.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid

import pytest

from grpo_mega.envs.sandbox import Sandbox, SandboxConfig, remove_tree
from tests import REPO
from tests.unit.envs.sandbox_probe import needs_sandbox



@pytest.fixture
def temp_root(tmp_path, monkeypatch):
    """The sandbox's temporary root, watched: tempfile's directory points here."""
    root = tmp_path / "tmproot"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


def run(code: str, **limits):
    return Sandbox(SandboxConfig(**limits)).run(textwrap.dedent(code))


def _processes_with(marker: str) -> list[str]:
    """Pids of live processes whose name (the code sets it) or command line (the sandbox
    child's holds its scratch path) holds ``marker``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{pid}/comm", "rb") as f:
                comm = f.read()
            with open(f"/proc/{pid}/stat", "rb") as f:
                zombie = f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
        except OSError:
            continue
        if not zombie and (marker.encode() in cmd or marker.encode() in comm):
            found.append(pid)
    return found


@needs_sandbox
def test_sandbox_cannot_change_mode_times_or_xattrs_of_host_files(tmp_path):
    """Finding 1: Landlock does not cover chmod, utime, chown or setxattr, and the code ran
    as (mapped) root, so ``os.chmod(path, 0o4755)`` and ``os.utime(path, (0, 0))`` worked
    on any file outside the scratch; through a descriptor (fchmod, futimens) on any file
    it can read. The files' mode, mtime and xattrs must be unchanged afterwards."""
    outside = tmp_path / "key.pem"
    outside.write_text("secret")
    ro = tmp_path / "ro"
    ro.mkdir()
    readable = ro / "tool.py"
    readable.write_text("x = 1")
    for p in (outside, readable, ro):
        os.chmod(p, 0o700 if p.is_dir() else 0o600)
        os.utime(p, (1000, 1000))
    try:
        os.setxattr(outside, "user.probe", b"1")
        os.removexattr(outside, "user.probe")
        xattrs = True
    except OSError:
        xattrs = False  # a host filesystem without user xattrs: that part is moot
    before = {p: (os.stat(p).st_mode, os.stat(p).st_mtime_ns, os.stat(p).st_uid, os.stat(p).st_gid)
              for p in (outside, readable, ro)}
    code = f"""
        import os
        for path in ({str(outside)!r}, {str(ro)!r}, {str(readable)!r}):
            for f in (lambda: os.chmod(path, 0o4777), lambda: os.utime(path, (0, 0)),
                      lambda: os.chown(path, os.getuid(), 12345), lambda: os.setxattr(path, "user.x", b"1"),
                      lambda: os.utime(path, ns=(0, 0), follow_symlinks=False)):
                try:
                    f()
                except OSError:
                    pass
        fd = os.open({str(readable)!r}, os.O_RDONLY)
        for f in (lambda: os.fchmod(fd, 0o4777), lambda: os.utime(fd, (0, 0)),
                  lambda: os.setxattr(fd, "user.x", b"1")):
            try:
                f()
            except OSError:
                pass
        print("done")
        """
    r = Sandbox(SandboxConfig(read_roots=(str(ro),))).run(textwrap.dedent(code))
    assert r.stdout == "done\n" and r.unbuilt is None, r
    after = {p: (os.stat(p).st_mode, os.stat(p).st_mtime_ns, os.stat(p).st_uid, os.stat(p).st_gid)
             for p in (outside, readable, ro)}
    assert after == before
    if xattrs:
        assert os.listxattr(outside) == [] and os.listxattr(readable) == []


@needs_sandbox
def test_sandbox_cannot_connect_to_a_host_unix_socket_or_use_io_uring(tmp_path):
    """Finding 2: the code could connect() to any pathname AF_UNIX socket whose path it
    knew (a Docker or D-Bus socket: code execution outside), even in a directory it
    cannot list; io_uring (whose operations no seccomp filter sees) was not refused. The
    host's listening socket must see no connection; io_uring_setup must fail."""
    hidden = tmp_path / "hidden"
    hidden.mkdir(mode=0o711)
    path = str(hidden / "daemon.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(8)
    server.setblocking(False)
    try:
        r = run(f"""
            import ctypes, socket
            for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM, socket.SOCK_SEQPACKET):
                try:
                    socket.socket(socket.AF_UNIX, kind).connect({path!r})
                except OSError:
                    pass
            params = (ctypes.c_uint32 * 30)()
            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.syscall(425, 4, ctypes.byref(params))
            print("io_uring", "refused" if fd < 0 else "allowed")
            a, b = socket.socketpair()  # asyncio's self-pipe: still works
            a.send(b"x")
            print(b.recv(1))
            """)
        assert r.stdout.splitlines() == ["io_uring refused", "b'x'"], r
        with pytest.raises(BlockingIOError):
            server.accept()
    finally:
        server.close()


SETSID_AND_HIDE = """
    import ctypes, os, time
    libc = ctypes.CDLL(None)
    libc.prctl(15, ({name}).encode(), 0, 0, 0)  # PR_SET_NAME: findable in /proc
    print("pdeathsig", "cleared" if libc.prctl(1, 0, 0, 0, 0) == 0 else "kept", flush=True)
    for escape in (os.setsid, lambda: os.setpgid(0, 0)):
        try:
            escape()
            print("left the process group", flush=True)
        except OSError:
            print("refused", flush=True)
    os.close(1); os.close(2)
    time.sleep(30)
    """


@needs_sandbox
def test_sandbox_leaves_no_process_after_setsid_and_closed_output(temp_root):
    """Finding 3: ``os.setsid()`` plus closing stdout/stderr left the code running after
    run() returned (the parent killed only the original process group). When run()
    returns, no process of the call may be left, and the escape calls are refused."""
    marker = "gm" + uuid.uuid4().hex[:10]
    r = run(SETSID_AND_HIDE.format(name=repr(marker)), wall_seconds=1)
    assert _processes_with(marker) == [] and _processes_with(str(temp_root)) == [], r
    assert r.stdout.splitlines() == ["pdeathsig kept", "refused", "refused"], r


_KILLED_TRAINER = """
import sys, textwrap
from grpo_mega.envs.sandbox import Sandbox
Sandbox().run(textwrap.dedent(sys.argv[1]))
"""


@needs_sandbox
def test_sandbox_processes_die_with_a_killed_trainer(tmp_path):
    """Finding 3, the trainer's side: a trainer killed (OOM, SIGKILL) mid-call left the
    relay and the code running (sleeping code has no CPU limit to hit). PID 1 of the
    namespace and the relay both die with their parent (PR_SET_PDEATHSIG), and the code
    cannot clear PID 1's (it tries)."""
    marker = "gm" + uuid.uuid4().hex[:10]
    # spelled backwards in the trainer's command line: only the code's process name matches
    code = SETSID_AND_HIDE.format(name=f"{marker[::-1]!r}[::-1]")
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)}
    trainer = subprocess.Popen([sys.executable, "-c", _KILLED_TRAINER, code], env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + 20
        while not _processes_with(marker):
            assert time.monotonic() < deadline and trainer.poll() is None, "the tool code never started"
            time.sleep(0.02)
    finally:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
    deadline = time.monotonic() + 2
    while (_processes_with(marker) or _processes_with(str(tmp_path))) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _processes_with(marker) == [] and _processes_with(str(tmp_path)) == []


@needs_sandbox
def test_sandbox_deep_tree_leaves_nothing_and_raises_nothing(temp_root):
    """Finding 4: about 1,200 nested mkdir/chdir made Sandbox.run raise RecursionError
    into the caller (shutil.rmtree recurses) and left the scratch behind (469 MiB from
    one call). The call must return normally and leave the temporary root empty."""
    r = run("""
        import os
        for i in range(1500):
            os.mkdir("d")
            os.chdir("d")
        open("f", "w").write("x" * 1000)
        print("deep")
        """)
    assert r.stdout == "deep\n", r
    assert os.listdir(temp_root) == []


@needs_sandbox
def test_sandbox_scratch_bytes_are_bounded(temp_root):
    """Finding 4, the bytes: the scratch was the host's disk, bounded only per file
    (RLIMIT_FSIZE), so one call could fill it. Now a tmpfs of ``scratch_mb``: the code
    cannot write more than that in all, and nothing reaches the temporary root."""
    r = run("""
        import os
        written = 0
        try:
            for i in range(12):
                with open(f"f{i}", "wb") as f:
                    f.write(b"x" * (1 << 20))
                written += 1
        except OSError as e:
            print("stopped", e.errno)
        print(written)
        """, scratch_mb=8, max_file_mb=2)
    lines = r.stdout.split()
    assert lines[:2] == ["stopped", "28"] and int(lines[2]) <= 8, r  # ENOSPC at 8 MiB
    assert os.listdir(temp_root) == []


def test_remove_tree_removes_a_deep_locked_tree_without_raising(tmp_path):
    """Finding 4, the cleanup: Python 3.11's shutil.rmtree and os.walk recurse, so a deep
    tree raised RecursionError into the trainer. ``remove_tree`` walks iteratively, one
    descriptor at a time, and opens directories set to mode 000."""
    top = tmp_path / "scratch"
    top.mkdir()
    fd = os.open(top, os.O_RDONLY)
    for _ in range(1200):  # past Python's recursion limit (1000)
        os.mkdir("d", dir_fd=fd)
        new = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = new
    os.close(os.open("f", os.O_CREAT | os.O_WRONLY, dir_fd=fd))
    os.close(fd)
    os.chmod(top / "d", 0)
    try:
        remove_tree(str(top))
        assert os.listdir(tmp_path) == []
    finally:
        # never leave the deep tree behind: pytest's own clean-up of old temporary
        # directories is Python 3.11's recursive rmtree and would raise RecursionError
        # in a later session (seen while running the catalogue on a broken remove_tree)
        if top.exists():
            with contextlib.suppress(OSError):
                os.chmod(top / "d", 0o700)
            subprocess.run(["rm", "-rf", str(top)], check=False)


@needs_sandbox
def test_sandbox_cannot_truncate_host_files_on_landlock_abi_below_3(tmp_path):
    """Finding 5: Landlock ABI 1-2 (Linux 5.13-6.1) cannot refuse truncate(path), so the
    code could empty any file its uid can write (a checkpoint, a data file). Run with the
    ruleset of such a kernel: the host file keeps its bytes."""
    victim = tmp_path / "model.safetensors"
    victim.write_bytes(b"w" * 4096)
    sandbox = Sandbox()
    sandbox._landlock_abi_cap = 2
    r = sandbox.run(f"""
import os
try:
    os.truncate({str(victim)!r}, 0)
except OSError:
    pass
print("done")""")
    assert r.stdout == "done\n", r
    assert victim.stat().st_size == 4096


_AS_NOBODY = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("sandbox", sys.argv[1])
sandbox = importlib.util.module_from_spec(spec)
sys.modules["sandbox"] = sandbox
spec.loader.exec_module(sandbox)
print(sandbox.Sandbox().run("import os, fractions; print(os.getuid(), os.getgid(), os.getgroups())").stdout, end="")
"""
SYSTEM_PYTHON = "/usr/bin/python3"


@needs_sandbox
@pytest.mark.skipif(os.geteuid() != 0, reason="the uid is dropped only where the trainer is root")
@pytest.mark.skipif(not os.access(SYSTEM_PYTHON, os.X_OK), reason=f"needs {SYSTEM_PYTHON}")
def test_sandbox_of_a_root_trainer_runs_code_as_nobody():
    """Finding 1, the uid: the code ran as uid 0 mapped to the host's root, so any call the
    filter missed acted as the owner of the trainer's files. Where the Python installation
    is readable by others (the system Python here; sandbox.py needs only the standard
    library), a root trainer's code runs as 65534, without supplementary groups."""
    sandbox_py = REPO / "grpo_mega" / "envs" / "sandbox.py"
    r = subprocess.run([SYSTEM_PYTHON, "-I", "-c", _AS_NOBODY, str(sandbox_py)], capture_output=True, text=True,
                       timeout=60, env={"PATH": "/usr/bin:/bin"})  # TMPDIR: /tmp, which others can reach
    if "cannot reach the Python installation" in r.stderr:
        pytest.skip(f"{SYSTEM_PYTHON}'s installation or /tmp is not reachable by others here")
    assert r.stdout == "65534 65534 []\n", r.stdout + r.stderr


def _kernel_allows_the_sandbox() -> bool:
    """User namespaces allowed, Landlock answering its ABI version, a known architecture."""
    import ctypes

    try:
        with open("/proc/sys/user/max_user_namespaces") as f:
            userns = int(f.read()) > 0
    except (OSError, ValueError):
        return False
    landlock = ctypes.CDLL(None).syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1)) > 0
    if userns and shutil.which("unshare"):  # an LSM (Ubuntu's AppArmor) may still refuse them
        userns = subprocess.run(["unshare", "-r", "true"], capture_output=True).returncode == 0
    return userns and landlock and os.uname().machine in ("x86_64", "aarch64")


@pytest.mark.skipif(not _kernel_allows_the_sandbox(), reason="no user namespaces or Landlock here")
def test_sandbox_builds_where_the_kernel_allows_it():
    """Guards against a sandbox that stopped building (a step that fails under its own
    filter, say): every test above would then be skipped, not failed. Where the kernel
    offers user namespaces and Landlock, ``check`` must succeed and code must run."""
    Sandbox().check()
    assert Sandbox().run("print(6 * 7)").stdout == "42\n"
