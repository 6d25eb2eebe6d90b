"""Run model-written Python in a confined child process; what comes back is text.

:meth:`Sandbox.run` starts a fresh ``python -I -S`` (``sandbox_child.py``, which confines
itself before it runs the code: namespaces, a tmpfs scratch, Landlock, seccomp, rlimits;
its docstring has the order and the reasons), gives it the code on stdin and reads its
stdout and stderr, and returns a :class:`SandboxResult`, whose
:meth:`~SandboxResult.text` is what the model reads. Nothing raises here: a crash, a
hang, a loop, a memory bomb, an output flood, a network attempt, a 1,200-deep directory
tree each ends as a short message in that text. A sandbox that cannot be *built* (no
user namespaces, no Landlock, no syscall table for the machine) runs nothing (fail
closed); :meth:`Sandbox.check`, which the environments call when they are made, turns
that into :class:`SandboxUnavailable` at start-up, naming the kernel feature and the flag
that opts out.

What it guarantees against hostile code (docs/concepts/security.md has the whole list and
the kernels): no change to any host file, contents or metadata (Landlock for contents;
the seccomp filter for chmod, chown, utime, xattrs, which Landlock does not cover; uid
65534 where the trainer is root and the Python installation is readable by others); no
reads outside the scratch, the Python installation, the system library directories and
``read_roots``; no network, no Unix sockets, no io_uring; no process of the call left
when :meth:`Sandbox.run` returns, nor after the trainer is killed (``setsid`` refused,
the namespace's PID 1 dies with the relay, the relay with the trainer's thread, and
``run`` waits for PID 1's end); no bytes left on the host (the scratch is a tmpfs of
``scratch_mb`` in the call's own mount namespace; the empty host directory under it is
removed by :func:`remove_tree`, which never raises).

Limits (:class:`SandboxConfig`): CPU seconds (``RLIMIT_CPU``, SIGKILL), address space
(``RLIMIT_AS``: an allocation past it raises ``MemoryError`` in the code), file size
(``RLIMIT_FSIZE``) and scratch size (the tmpfs), no new processes (seccomp; threads
allowed, ``RLIMIT_NPROC``), open files, a wall-clock deadline (the process group is
killed; the PID namespace takes every descendant with it) and an output budget (stdout
and stderr together; past it the child is killed and the text says it was truncated).
An environment of five fixed variables, nothing inherited; stdin ``/dev/null``. Code and
results cross as text (stdin, pipes, JSON status lines), never pickle.

Why hand-written namespaces, Landlock and seccomp rather than bubblewrap: bubblewrap
builds the same namespaces and mount view, but it is not installed on the CI and
development machines nor on many HPC nodes, it leaves the seccomp policy (the part that
refuses metadata changes, Unix sockets and io_uring) to its caller as a compiled filter
anyway, and it is one more privileged binary to trust. This needs only the standard
library and a kernel feature set checked at start-up.

Cost: a median of about 41 ms per call on the 2-core development machine at load 2
(``benchmarks/bench_sandbox.py``), about 4 ms more than before issue 38's layers, of which
6 ms is the interpreter's start and 12 ms the child's imports (docs/guides/environments.md
has the measurements).
"""
from __future__ import annotations

import json
import logging
import os
import select
import selectors
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["SandboxConfig", "SandboxResult", "SandboxUnavailable", "Sandbox", "run_python"]

log = logging.getLogger(__name__)
CHILD = Path(__file__).with_name("sandbox_child.py")
# Where the interpreter may read and execute: the Python installation (stdlib, lib-dynload)
# and the shared libraries its extension modules load. Everything else (the data files
# with the reference answers, the checkpoints, /proc, /etc, /dev/shm) is unreadable.
SYSTEM_READ_ROOTS = ("/usr", "/lib", "/lib64", "/lib32")
NOBODY = 65534


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot be built on this machine as configured (fail closed)."""


@dataclass(frozen=True)
class SandboxConfig:
    """Limits of one sandboxed run. Environments take it as their ``sandbox`` kwarg
    (a mapping in YAML: ``sandbox: {cpu_seconds: 2, memory_mb: 256}``)."""

    cpu_seconds: float = 2.0
    """CPU time of the code (rounded up to whole seconds, the rlimit's unit); past it the
    kernel kills it."""
    wall_seconds: float = 5.0
    """Wall-clock deadline of the whole call, start-up included; past it every process
    of the sandbox is killed."""
    memory_mb: int = 256
    """Address-space limit per process (``RLIMIT_AS``); the interpreter itself takes ~20."""
    max_output_bytes: int = 4096
    """stdout and stderr together; past it the code is killed and the text truncated."""
    max_file_mb: int = 16
    """Largest file the code may write (``RLIMIT_FSIZE``)."""
    scratch_mb: int = 64
    """Size of the code's scratch directory, a private tmpfs (all its files together; past
    it writes fail with ENOSPC). It lives in memory, charged to the trainer's memory
    while the call runs, and vanishes with the call."""
    max_threads: int = 16
    """Threads (tasks) the code may have at once (``RLIMIT_NPROC``; the kernel exempts a
    trainer run as root, where ``memory_mb`` bounds threads through their stacks)."""
    allow_subprocesses: bool = False
    """Let the code start processes (bounded by ``max_threads``). Off: a seccomp filter
    makes fork, vfork and process-creating clone fail (threads still work), so a fork bomb
    cannot start, root or not."""
    max_open_files: int = 64
    """File descriptors per process (``RLIMIT_NOFILE``)."""
    max_code_bytes: int = 65536
    """Longer code is refused with a message, not run."""
    echo_last_expression: bool = True
    """Print the value of a final expression statement, as an interactive interpreter does."""
    read_roots: tuple[str, ...] = ()
    """Directories the code may read besides the Python installation and the system
    library directories (e.g. a folder of task files)."""
    unsafe_no_netns: bool = False
    """Run even where no network namespace can be made (the code then has the host's
    network; logged on every run). Off: such a machine refuses to run tool code."""
    unsafe_no_landlock: bool = False
    """Run even where Landlock is missing (the code may then read and write wherever its
    uid may; logged on every run). Off: such a machine refuses to run tool code."""

    def __post_init__(self) -> None:
        for name in ("cpu_seconds", "wall_seconds", "memory_mb", "max_output_bytes", "max_file_mb", "scratch_mb",
                     "max_threads", "max_open_files", "max_code_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"sandbox.{name} must be > 0, got {getattr(self, name)!r}")

    @classmethod
    def coerce(cls, value: "SandboxConfig | dict | None") -> "SandboxConfig":
        """From a config mapping; an unknown key is an error naming it."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise TypeError(f"sandbox: expected a mapping of SandboxConfig fields, got {value!r}")
        unknown = sorted(set(value) - set(cls.__dataclass_fields__))
        if unknown:
            raise TypeError(f"sandbox: unknown key(s) {unknown}; known: {sorted(cls.__dataclass_fields__)}")
        return cls(**{k: tuple(v) if k == "read_roots" else v for k, v in value.items()})


@dataclass
class SandboxResult:
    """What one run left: its output, how it ended, and why it was stopped if it was."""

    stdout: str
    stderr: str
    exit_code: int | None
    """The code's exit status (128 + N when killed by signal N)."""
    error: str | None
    """Why the sandbox stopped the code ("wall-clock timeout ...", "CPU time limit ...",
    "output limit ..."), None when the code ended on its own."""
    truncated: bool
    seconds: float
    unbuilt: str | None = None
    """Why the sandbox could not be built (the code did not run; see :meth:`Sandbox.check`)."""

    @property
    def ok(self) -> bool:
        return self.error is None and self.exit_code == 0

    def text(self) -> str:
        """The tool message the model reads: stdout, then stderr, then a bracketed note on
        truncation, a stop or a non-zero exit."""
        parts = [p.rstrip("\n") for p in (self.stdout, self.stderr) if p.strip()]
        if self.truncated:
            parts.append("[output truncated]")
        if self.error:
            parts.append(f"[error: {self.error}]")
        elif self.exit_code not in (0, None) and not self.stderr.strip():
            parts.append(f"[exit status {self.exit_code}]")
        return "\n".join(parts) if parts else "[no output]"


_CHECKED: dict[tuple, None] = {}
_CHECK_LOCK = threading.Lock()


class Sandbox:
    """Runs code under one :class:`SandboxConfig`. Thread-safe: each call has its own
    process and directory."""

    _landlock_abi_cap: int | None = None
    """Tests only: confine as on a kernel whose Landlock ABI is at most this."""

    def __init__(self, config: SandboxConfig | dict | None = None):
        self.config = SandboxConfig.coerce(config)

    def check(self) -> None:
        """Build the sandbox once (cached per configuration and process) and raise
        :class:`SandboxUnavailable`, naming the opt-out flag, if it cannot be built."""
        key = tuple(sorted(asdict(self.config).items()))
        with _CHECK_LOCK:
            if key not in _CHECKED:
                result = self.run("pass")
                if result.unbuilt:
                    raise SandboxUnavailable(result.unbuilt)
                _CHECKED[key] = None

    def run(self, code: str) -> SandboxResult:
        """Run ``code``; never raises (see the module docstring). A sandbox that cannot be
        built does not run the code (fail closed): the result's ``unbuilt`` says why, its
        text tells the model the tool is unavailable, and the reason is logged."""
        cfg = self.config
        start = time.monotonic()
        if len(code.encode()) > cfg.max_code_bytes:
            return SandboxResult("", "", None, f"code longer than {cfg.max_code_bytes} bytes, not run",
                                 False, 0.0)
        try:
            tmp = tempfile.mkdtemp(prefix="grpo-sandbox-")
            uid = _unprivileged_uid()
            if uid is not None:
                os.chown(tmp, uid, uid)
        except OSError as e:  # a full or read-only temporary directory
            return _unbuilt(f"cannot make the sandbox's directory: {e}", start)
        try:
            return self._run(code, tmp, start, uid)
        finally:
            remove_tree(tmp)

    def _settings(self, tmp: str, status_fd: int, uid: int | None) -> dict:
        cfg = self.config
        prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                    str(Path(sys.executable).resolve().parent.parent)}
        return {"status_fd": status_fd, "write_root": tmp, "uid": uid, "scratch_bytes": cfg.scratch_mb << 20,
                "landlock_abi_cap": self._landlock_abi_cap,
                "read_roots": sorted(prefixes | set(SYSTEM_READ_ROOTS) | set(cfg.read_roots)),
                "cpu_seconds": cfg.cpu_seconds, "memory_bytes": cfg.memory_mb << 20,
                "file_bytes": cfg.max_file_mb << 20, "max_threads": cfg.max_threads,
                "allow_subprocesses": cfg.allow_subprocesses,
                "max_open_files": cfg.max_open_files, "echo_last_expression": cfg.echo_last_expression,
                "unsafe_no_netns": cfg.unsafe_no_netns, "unsafe_no_landlock": cfg.unsafe_no_landlock}

    def _run(self, code: str, tmp: str, start: float, uid: int | None) -> SandboxResult:
        cfg = self.config
        status_r, status_w = os.pipe()
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-X", "utf8", str(CHILD), json.dumps(self._settings(tmp, status_w, uid))],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp, env=env,
                pass_fds=(status_w,), start_new_session=True)
        except OSError as e:  # EAGAIN, ENOMEM on a loaded machine
            os.close(status_r)
            return _unbuilt(f"cannot start the sandbox process: {e}", start)
        finally:
            os.close(status_w)
        try:
            try:
                proc.stdin.write(code.encode())
                proc.stdin.close()
            except BrokenPipeError:
                pass  # the child died before reading: its status and stderr say why
            out, status, truncated, error, init = self._collect(proc, status_r, start)
        finally:
            _kill_group(proc)
            os.close(status_r)
        # wait4, not Popen.wait: its rusage (CPU of the child and the PID 1 it waited for)
        # tells a CPU-limit kill from any other SIGKILL.
        _, wstatus, usage = os.wait4(proc.pid, 0)
        _wait_gone(init)
        proc.returncode = os.waitstatus_to_exitcode(wstatus)
        code_ = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
        problem = _setup_problem(status, out[1], code_)
        if problem and not error:  # (killed before it reported: a stop, not a build failure)
            return _unbuilt(problem, start)
        if error is None and code_ == 128 + signal.SIGKILL:
            used = usage.ru_utime + usage.ru_stime
            error = (f"CPU time limit ({cfg.cpu_seconds:g} s) exceeded" if used >= int(cfg.cpu_seconds + 0.999) - 0.05
                     else "killed (SIGKILL)")
        decode = lambda b: b.decode("utf-8", errors="replace")  # noqa: E731
        return SandboxResult(decode(out[0]), decode(out[1]), code_, error, truncated, time.monotonic() - start)

    def _collect(self, proc: subprocess.Popen, status_r: int, start: float):
        """Read stdout, stderr and the status pipe until all close, the deadline passes or
        the output budget is spent: ``([stdout, stderr], status, truncated, error, init)``,
        ``init`` a pidfd of the namespace's PID 1 (None before it is reported)."""
        cfg = self.config
        budget = cfg.max_output_bytes
        out, status, truncated, error, init = [bytearray(), bytearray()], bytearray(), False, None, None
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ, 0)
        sel.register(proc.stderr, selectors.EVENT_READ, 1)
        sel.register(status_r, selectors.EVENT_READ, 2)
        try:
            while sel.get_map():
                left = start + cfg.wall_seconds - time.monotonic()
                if left <= 0:
                    error = f"wall-clock timeout ({cfg.wall_seconds:g} s)"
                    break
                for key, _ in sel.select(timeout=left):
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        sel.unregister(key.fileobj)
                    elif key.data == 2:
                        status += chunk
                        init = init if init is not None else _open_init(status)
                    else:
                        room = budget - len(out[0]) - len(out[1])
                        out[key.data] += chunk[:room]
                        if len(chunk) > room:
                            truncated, error = True, f"output limit ({budget} bytes) reached, stopped"
                if error:
                    break
        finally:
            sel.close()
        return out, bytes(status), truncated, error, init


def _setup_problem(status: bytes, stderr: bytes, exit_code: int) -> str | None:
    """None when the child reported a built sandbox (its warnings, the unsafe fallbacks,
    are logged), else why it was not built, with the flag that opts out where one does."""
    lines = [m for m in _status_lines(status) if "ok" in m]
    if lines and lines[-1].get("ok"):
        for w in lines[-1].get("warnings", []):
            log.warning("sandbox (unsafe fallback allowed by config): %s", w)
        return None
    reason = lines[-1]["error"] if lines else (
        f"the sandbox process exited with status {exit_code} before confining itself: "
        + stderr.decode(errors="replace").strip()[-500:])
    hint = ""
    if "CLONE_NEWNET" in reason or "CLONE_NEWUSER" in reason or "uid_map" in reason:
        hint = ("; unprivileged user namespaces are needed (sysctls user.max_user_namespaces > 0, "
                "kernel.unprivileged_userns_clone=1, on Ubuntu kernel.apparmor_restrict_unprivileged_userns=0). To run tool code with "
                "the host's network instead, set the environment kwarg sandbox.unsafe_no_netns=true")
    elif "andlock" in reason:
        hint = ("; to run tool code without filesystem confinement, set the environment kwarg "
                "sandbox.unsafe_no_landlock=true")
    return f"cannot build the tool sandbox: {reason}{hint}"


def _unbuilt(reason: str, start: float) -> SandboxResult:
    log.error("%s (the tool call was not run)", reason)
    return SandboxResult("", "", None, "the sandbox is unavailable, the code was not run", False,
                         time.monotonic() - start, unbuilt=reason)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child's process group (the child and PID 1 of its namespace; the
    kernel then kills the rest of the namespace)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for f in (proc.stdout, proc.stderr):
        f.close()


def _status_lines(status: bytes) -> list[dict]:
    return [json.loads(line) for line in status.decode(errors="replace").splitlines() if line.strip()]


def _open_init(status: bytes) -> int | None:
    """A pidfd of PID 1 once the relay has reported it. Opened while the relay, its
    parent, is alive and has not reaped it, so the pid names that process (no reuse)."""
    for m in _status_lines(status[:status.rfind(b"\n") + 1]):
        if "init_pid" in m:
            try:
                return os.pidfd_open(m["init_pid"])
            except OSError:  # already gone
                return -1
    return None


def _wait_gone(pidfd: int | None, timeout: float = 5.0) -> None:
    """Wait until PID 1 has exited: the relay's death sends it SIGKILL (PDEATHSIG), and it
    exits only after the kernel has killed every other process of its namespace. So
    when :meth:`Sandbox.run` returns, no process of the call is left."""
    if pidfd is None or pidfd < 0:
        return
    try:
        if not select.select([pidfd], [], [], timeout)[0]:
            log.error("sandbox: PID 1 of a finished call still runs after %g s", timeout)
    finally:
        os.close(pidfd)


def _unprivileged_uid() -> int | None:
    """The uid the code runs as where the trainer is root: 65534 (nobody), if that user can
    reach the Python installation and the temporary root (every directory above them
    searchable by others); else None (the user namespace then maps root to root, without
    capabilities; logged once)."""
    if os.geteuid() != 0:
        return None
    return NOBODY if _others_can_reach(_python_dirs()) else _warn_root_once()


def _python_dirs() -> set[str]:
    return {sys.base_prefix, sys.base_exec_prefix, os.path.dirname(os.path.realpath(sys.executable)),
            os.path.dirname(os.__file__), str(CHILD.parent), tempfile.gettempdir()}


def _others_can_reach(paths) -> bool:
    for path in paths:
        p = os.path.realpath(path)
        while True:
            try:
                if not os.stat(p).st_mode & stat.S_IXOTH:
                    return False
            except OSError:
                return False
            if p == "/":
                break
            p = os.path.dirname(p)
    return True


_ROOT_WARNED: list = []


def _warn_root_once() -> None:
    if not _ROOT_WARNED:
        _ROOT_WARNED.append(True)
        log.warning("sandbox: the trainer is root and user %d cannot reach the Python installation (%s) or the "
                    "temporary root (%s); tool code runs as root mapped to root, without capabilities (the "
                    "seccomp filter refuses the metadata calls). Install Python, and point TMPDIR, where others "
                    "can read to run tool code as nobody.", NOBODY, sys.base_prefix, tempfile.gettempdir())
    return None


def remove_tree(path: str) -> None:
    """Remove ``path`` and everything beneath it; never raises, however deep the tree (an
    iterative walk, one directory descriptor open at a time, names relative to it: no
    recursion, no path length limit). Left-overs are logged. With the tmpfs scratch the
    host's directory is empty; this matters where the namespaces could not be made."""
    try:
        os.rmdir(path)
        return
    except FileNotFoundError:
        return
    except OSError:
        pass
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    names: list[str] = []  # the directories descended into, below path
    fd = None
    try:
        fd = os.open(path, flags)
        for _ in range(10_000_000):  # a bound, not a limit any real tree reaches
            child = None
            with os.scandir(fd) as it:
                for entry in it:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            child = entry.name
                            break
                        os.unlink(entry.name, dir_fd=fd)
                    except OSError:
                        pass
            if child is not None:
                try:
                    os.chmod(child, 0o700, dir_fd=fd)  # a mode of 000 must not stop the removal
                    new = os.open(child, flags, dir_fd=fd)
                except OSError:
                    log.error("sandbox: cannot enter %s/%s to remove it", path, "/".join(names + [child]))
                    break
                os.close(fd)
                fd = new
                names.append(child)
                continue
            if not names:
                break
            parent = os.open("..", flags, dir_fd=fd)
            os.close(fd)
            fd = parent
            os.rmdir(names.pop(), dir_fd=fd)
    except OSError as e:
        log.error("sandbox: cannot remove %s: %s", path, e)
    finally:
        if fd is not None:
            os.close(fd)
    try:
        os.rmdir(path)
    except OSError as e:
        log.error("sandbox: left %s behind: %s", path, e)


def run_python(code: str, config: SandboxConfig | dict | None = None) -> str:
    """The text the model reads after running ``code`` (a convenience for tools)."""
    return Sandbox(config).run(code).text()
