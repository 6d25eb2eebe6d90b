"""The sandbox's child side: confine this process, then run the model's code.

Run only by :mod:`grpo_mega.envs.sandbox`, as ``python -I -S -X utf8 sandbox_child.py
SETTINGS_JSON``, with the model's code on stdin, cwd and ``TMPDIR`` a fresh temporary
directory, and a minimal environment. It imports only the standard library (``-I -S``:
no site-packages, no ``PYTHON*`` variables, no script directory on ``sys.path``).

The order matters, each step needing what the one before left:

1. read the code (stdin), then point fd 0 at ``/dev/null``: the code has no stdin;
2. ``unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID)``: a network namespace whose
   only interface (``lo``) is down, so every connect fails; a PID namespace, so every
   process the code starts dies with it (the kernel kills a namespace's processes when
   its first one exits, and the parent's ``killpg`` reaches that one);
3. ``fork``: the child is PID 1 of the new namespace; the parent only waits and relays
   its exit status;
4. in PID 1: no new privileges (Landlock and seccomp need it), Landlock (writes only
   beneath the temporary directory, reads and executes only beneath it, the Python
   installation and the system library directories, no TCP connect or bind, no signals
   or abstract sockets outside), no capabilities, a seccomp filter refusing new
   processes (threads stay possible), then the rlimits (``RLIMIT_NPROC`` after ``unshare``: the kernel counts it per user
   namespace, so parallel sandboxes do not share one budget; it does not bind root);
5. report ``{"ok": true}`` (or the failure) on the status pipe and close it, so the
   parent tells a sandbox that could not be built (fail closed) from code that exits
   with any status it likes; then run the code, echoing a final expression's value like
   a REPL does.
"""
import ast
import ctypes
import json
import os
import resource
import sys

CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWPID = 0x10000000, 0x40000000, 0x20000000
PR_SET_NO_NEW_PRIVS = 38
# Landlock (include/uapi/linux/landlock.h); the syscall numbers are the same on every
# architecture (444-446 in the unified table).
SYS_CREATE_RULESET, SYS_ADD_RULE, SYS_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_WRITE_V1 = sum(1 << i for i in range(4, 13))  # remove dir/file, make char/dir/reg/sock/fifo/block/sym
FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1

libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    """The sandbox could not be built as asked; reported on the status pipe."""


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(err)} (errno {err})")
    return ret


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 when Landlock is absent or disabled."""
    ret = libc.syscall(SYS_CREATE_RULESET, None, ctypes.c_size_t(0),
                       ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
    return max(ret, 0)


def landlock(write_root: str, read_roots: list) -> None:
    """Writes only beneath ``write_root``; reads and executes only beneath it and
    ``read_roots``; no TCP (ABI >= 4); no signals or abstract unix sockets outside the
    domain (ABI >= 6). Each right is handled only where the kernel knows it."""
    abi = landlock_abi()
    if abi < 1:
        raise SetupError("Landlock is not available in this kernel (needs Linux >= 5.13 with "
                         "landlock in the lsm= list)")
    read = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
    write = FS_WRITE_FILE | FS_WRITE_V1 | (FS_REFER if abi >= 2 else 0) | (FS_TRUNCATE if abi >= 3 else 0)
    attr = _RulesetAttr(read | write | (FS_IOCTL_DEV if abi >= 5 else 0),
                        NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0,
                        SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0)
    size = ctypes.sizeof(_RulesetAttr) if abi >= 6 else (16 if abi >= 4 else 8)
    ruleset = _check(libc.syscall(SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size),
                                  ctypes.c_uint32(0)), "landlock_create_ruleset")
    rules = [(write_root, read | write)] + [(p, read) for p in read_roots]
    rules += [(p, FS_READ_FILE | FS_WRITE_FILE) for p in ("/dev/null", "/dev/zero", "/dev/urandom")]
    for path, access in rules:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue  # a read root this system lacks (/lib64 on some distributions)
        if not os.path.isdir(path):
            access &= FS_EXECUTE | FS_READ_FILE | FS_WRITE_FILE | (FS_TRUNCATE if abi >= 3 else 0)
        rule = _PathBeneath(access, fd)
        _check(libc.syscall(SYS_ADD_RULE, ruleset, LANDLOCK_RULE_PATH_BENEATH, ctypes.byref(rule),
                            ctypes.c_uint32(0)), f"landlock_add_rule({path})")
        os.close(fd)
    _check(libc.syscall(SYS_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)), "landlock_restrict_self")
    os.close(ruleset)


# seccomp: refuse new processes, allow new threads. Per architecture: the audit arch and
# the numbers of clone, clone3, fork and vfork (aarch64 has no fork or vfork).
SECCOMP_ARCHES = {"x86_64": (0xC000003E, 56, 435, 57, 58), "aarch64": (0xC00000B7, 220, 435, None, None)}
CLONE_THREAD = 0x00010000
EAGAIN, ENOSYS = 11, 38
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
RET_ALLOW, RET_ERRNO, RET_KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000
LD_ABS, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def forbid_new_processes() -> None:
    """A seccomp filter: ``fork``, ``vfork`` and a ``clone`` without ``CLONE_THREAD``
    fail with EAGAIN (what a process limit gives), ``clone3`` with ENOSYS (its flags sit
    in memory a filter cannot read; glibc then falls back to ``clone`` for threads), and
    a syscall of another ABI (32-bit, x32) kills the process. Threads stay possible."""
    machine = os.uname().machine
    if machine not in SECCOMP_ARCHES:
        raise SetupError(f"seccomp filter: no syscall table for architecture {machine!r}")
    arch, clone, clone3, fork, vfork = SECCOMP_ARCHES[machine]
    deny, allow = RET_ERRNO | EAGAIN, RET_ALLOW
    # (code, jump-if-true, jump-if-false, k); jumps count instructions after this one.
    prog = [(LD_ABS, 0, 0, 4), (JEQ, 1, 0, arch), (RET, 0, 0, RET_KILL_PROCESS),
            (LD_ABS, 0, 0, 0), (JGE, 0, 1, 0x40000000), (RET, 0, 0, RET_KILL_PROCESS),
            (JEQ, 0, 1, clone3), (RET, 0, 0, RET_ERRNO | ENOSYS)]
    prog += [ins for nr in (fork, vfork) if nr is not None for ins in ((JEQ, 0, 1, nr), (RET, 0, 0, deny))]
    prog += [(JEQ, 1, 0, clone), (RET, 0, 0, allow),
             (LD_ABS, 0, 0, 16),  # args[0] (clone's flags), low 32 bits on a little-endian machine
             (JSET, 0, 1, CLONE_THREAD), (RET, 0, 0, allow), (RET, 0, 0, deny)]
    filters = (_SockFilter * len(prog))(*[_SockFilter(*ins) for ins in prog])
    fprog = _SockFprog(len(prog), filters)
    _check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "seccomp filter")


def new_namespaces(network: bool) -> None:
    """A user namespace (mapping our uid and gid to themselves), a PID namespace and,
    when ``network``, a network namespace."""
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWUSER | CLONE_NEWPID | (CLONE_NEWNET if network else 0)
    _check(libc.unshare(flags), "unshare(CLONE_NEWUSER|CLONE_NEWPID"
           + ("|CLONE_NEWNET)" if network else ")"))
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"{uid} {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{gid} {gid} 1")


def drop_capabilities() -> None:
    """No capabilities left in the new user namespace (the creator gets them all)."""
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = (ctypes.c_uint32 * 6)()
    _check(libc.capset(header, data), "capset")


def set_limits(s: dict) -> None:
    cpu = max(1, int(s["cpu_seconds"] + 0.999))
    # Soft == hard: the kernel then sends SIGKILL, which reaches a PID 1 (SIGXCPU at a soft
    # limit is ignored by a namespace's init that has no handler for it).
    limits = [(resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, s["memory_bytes"]),
              (resource.RLIMIT_FSIZE, s["file_bytes"]), (resource.RLIMIT_NPROC, s["max_threads"]),
              (resource.RLIMIT_NOFILE, s["max_open_files"]), (resource.RLIMIT_CORE, 0)]
    for which, value in limits:
        resource.setrlimit(which, (value, value))


def run_code(code: str, echo: bool) -> None:
    """Execute ``code`` as ``__main__``; with ``echo`` a final expression statement's
    value is printed (``repr``, unless None), as an interactive interpreter does. An
    exception prints a traceback of the code's own frames (this file's are noise to the
    model) and exits 1."""
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        tree = ast.parse(code, filename="<tool>")
        last = None
        if echo and tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, "<tool>", "exec"), namespace)
        if last is not None:
            value = eval(compile(last, "<tool>", "eval"), namespace)
            if value is not None:
                print(repr(value))
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - whatever the code raises is its output
        import linecache
        import traceback

        linecache.cache["<tool>"] = (len(code), None, code.splitlines(True), "<tool>")
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != "<tool>":
            tb = tb.tb_next
        sys.stdout.flush()
        traceback.print_exception(type(e), e, tb)
        sys.exit(1)


def main() -> None:
    s = json.loads(sys.argv[1])
    status = s["status_fd"]

    def report(**msg) -> None:
        os.write(status, (json.dumps(msg) + "\n").encode())

    code = sys.stdin.read()
    devnull = os.open("/dev/null", os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    warnings = []
    try:
        namespaces = True
        try:
            new_namespaces(network=True)
        except SetupError as e:
            if not s["unsafe_no_netns"]:
                raise
            warnings.append(f"no network namespace ({e}): the code runs with the host's network")
            try:
                new_namespaces(network=False)
            except SetupError:
                namespaces = False
                warnings.append("no PID namespace: stray processes are killed by process group only")
    except (SetupError, OSError) as e:
        report(ok=False, error=str(e))
        os._exit(1)
    if namespaces:
        pid = os.fork()
        if pid:  # the namespace's parent: relay PID 1's exit status
            os.close(status)
            _, st = os.waitpid(pid, 0)
            os._exit(os.waitstatus_to_exitcode(st) if os.WIFEXITED(st) else 128 + os.WTERMSIG(st))
    try:
        # no_new_privs first: Landlock and seccomp need it (or CAP_SYS_ADMIN, which the
        # fallback without a user namespace lacks).
        _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
        try:
            landlock(s["write_root"], s["read_roots"])
        except SetupError as e:
            if not s["unsafe_no_landlock"]:
                raise
            warnings.append(f"no Landlock ({e}): the code may read and write wherever its uid may")
        drop_capabilities()
        if not s["allow_subprocesses"]:
            forbid_new_processes()
        set_limits(s)
    except (SetupError, OSError) as e:
        report(ok=False, error=str(e))
        os._exit(1)
    report(ok=True, warnings=warnings)
    os.close(status)
    echo = s["echo_last_expression"]
    del s, report
    sys.argv = ["<tool>"]
    run_code(code, echo)


if __name__ == "__main__":
    main()
