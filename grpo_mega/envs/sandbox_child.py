"""The sandbox's child side: confine this process, then run the model's code.

Run only by :mod:`grpo_mega.envs.sandbox`, as ``python -I -S -X utf8 sandbox_child.py
SETTINGS_JSON``, with the model's code on stdin, cwd and ``TMPDIR`` a fresh, empty
temporary directory, and a minimal environment. It imports only the standard library
(``-I -S``: no site-packages, no ``PYTHON*`` variables, no script directory on ``sys.path``).

The order matters, each step needing what the one before left:

1. read the code (stdin), then point fd 0 at ``/dev/null``: the code has no stdin;
2. where the trainer is root and the settings name an unprivileged ``uid`` (65534), become
   it (groups, gid, uid): files the trainer owns are then not the code's, so even a call
   the filter below missed cannot act as their owner;
3. ``unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID)``: a network
   namespace whose only interface (``lo``) is down, so every connect fails; a mount
   namespace for the private scratch; a PID namespace, so every process the code starts
   dies with the namespace's first one;
4. ``fork``: the child is PID 1 of the new namespace; the parent (the "relay") reports
   PID 1's pid, then only waits and relays its exit status;
5. in PID 1: the scratch, a size-limited ``tmpfs`` mounted over the temporary directory
   (writes are bounded by ``scratch_bytes`` and never reach the host's disk: when the
   namespace dies the tmpfs is freed, so nothing is left to clean); no new privileges
   (Landlock and seccomp need it); Landlock (writes only beneath the scratch, reads and
   executes only beneath it, the Python installation and the system library
   directories, no TCP connect or bind, no signals or abstract sockets outside); no
   capabilities; ``PR_SET_PDEATHSIG(SIGKILL)``, so PID 1, and with it the whole
   namespace, dies when the relay does (the parent kills the relay's process group at
   the end of every call; the relay dies with the trainer); the seccomp filter
   (:func:`seccomp_filter`: no metadata changes, no sockets but IPv4/IPv6 ones, no
   io_uring, no new session or process group, no clearing the parent-death signal, no
   mount/ptrace/keyctl/bpf/perf/namespace calls, no new processes unless allowed); the
   rlimits (``RLIMIT_NPROC`` after ``unshare``: the kernel counts it per user namespace);
6. report ``{"ok": true}`` (or the failure) on the status pipe and close it, so the
   parent tells a sandbox that could not be built (fail closed) from code that exits
   with any status it likes; then run the code, echoing a final expression's value like
   a REPL does.

Kernels: user, mount, network and PID namespaces and seccomp filters (any Linux of the
last decade with unprivileged user namespaces), Landlock ABI >= 1 (Linux >= 5.13).
Landlock ABI 1-2 (Linux 5.13-6.1) cannot refuse ``truncate(path)``; the filter then
refuses that syscall for every path (``ftruncate`` needs a file opened for writing,
which Landlock does cover). x86_64 and aarch64 (the filter's syscall tables).
"""
import ast
import ctypes
import json
import os
import resource
import select
import sys

CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWPID, CLONE_NEWNS = 0x10000000, 0x40000000, 0x20000000, 0x00020000
PR_SET_NO_NEW_PRIVS, PR_SET_PDEATHSIG, PR_SET_DUMPABLE, SIGKILL = 38, 1, 4, 9
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 0x4000, 1 << 18
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


def landlock_abi(cap: "int | None" = None) -> int:
    """The kernel's Landlock ABI version, 0 when Landlock is absent or disabled; at most
    ``cap`` (the tests use it to run an older kernel's ruleset on a newer one)."""
    ret = libc.syscall(SYS_CREATE_RULESET, None, ctypes.c_size_t(0),
                       ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
    return max(ret, 0) if cap is None else min(max(ret, 0), cap)


def landlock(write_root: str, read_roots: list, abi: int) -> None:
    """Writes only beneath ``write_root``; reads and executes only beneath it and
    ``read_roots``; no TCP (ABI >= 4); no signals or abstract unix sockets outside the
    domain (ABI >= 6). Each right is handled only where the kernel knows it."""
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


# seccomp. Per architecture: the audit arch and the syscall numbers the filter names.
# Refused outright (EPERM), because Landlock does not cover them or they reach past the
# call: metadata changes (mode, owner, times, xattrs: Landlock checks none of them, and a
# root trainer's files are the code's own), new sessions and process groups, io_uring
# (its operations bypass this filter), and what reaches other processes or the kernel's
# shared state (ptrace, mount, namespaces, keys, bpf, perf, userfaultfd, file handles).
_DENY = ("fchmod fchmodat fchmodat2 fchown fchownat utimensat setxattr lsetxattr fsetxattr "
         "removexattr lremovexattr fremovexattr setxattrat removexattrat io_uring_setup "
         "io_uring_enter io_uring_register setsid setpgid ptrace mount umount2 pivot_root chroot "
         "unshare setns keyctl add_key request_key bpf perf_event_open userfaultfd "
         "process_vm_readv process_vm_writev name_to_handle_at open_by_handle_at fanotify_init "
         "open_tree move_mount fsopen fsconfig fsmount fspick mount_setattr kcmp pidfd_getfd "
         "quotactl acct syslog mknodat").split()
_X86_ONLY = {"chmod": 90, "chown": 92, "lchown": 94, "utime": 132, "utimes": 235, "futimesat": 261,
             "mknod": 133, "fork": 57, "vfork": 58}
_X86 = {"fchmod": 91, "fchmodat": 268, "fchown": 93, "fchownat": 260, "utimensat": 280, "setxattr": 188,
        "lsetxattr": 189, "fsetxattr": 190, "removexattr": 197, "lremovexattr": 198, "fremovexattr": 199,
        "setsid": 112, "setpgid": 109, "ptrace": 101, "mount": 165, "umount2": 166, "pivot_root": 155,
        "chroot": 161, "unshare": 272, "setns": 308, "keyctl": 250, "add_key": 248, "request_key": 249,
        "bpf": 321, "perf_event_open": 298, "userfaultfd": 323, "process_vm_readv": 310,
        "process_vm_writev": 311, "name_to_handle_at": 303, "open_by_handle_at": 304, "fanotify_init": 300,
        "kcmp": 312, "quotactl": 179, "acct": 163, "syslog": 103, "mknodat": 259, "truncate": 76,
        "socket": 41, "ioctl": 16, "fcntl": 72, "clone": 56, "prctl": 157, **_X86_ONLY}
# aarch64 uses the generic table (include/uapi/asm-generic/unistd.h): no chmod, fork, ...
_GENERIC = {"fchmod": 52, "fchmodat": 53, "fchown": 55, "fchownat": 54, "utimensat": 88, "setxattr": 5,
            "lsetxattr": 6, "fsetxattr": 7, "removexattr": 14, "lremovexattr": 15, "fremovexattr": 16,
            "setsid": 157, "setpgid": 154, "ptrace": 117, "mount": 40, "umount2": 39, "pivot_root": 41,
            "chroot": 51, "unshare": 97, "setns": 268, "keyctl": 219, "add_key": 217, "request_key": 218,
            "bpf": 280, "perf_event_open": 241, "userfaultfd": 282, "process_vm_readv": 270,
            "process_vm_writev": 271, "name_to_handle_at": 264, "open_by_handle_at": 265,
            "fanotify_init": 262, "kcmp": 272, "quotactl": 60, "acct": 89, "syslog": 116, "mknodat": 33,
            "truncate": 45, "socket": 198, "ioctl": 29, "fcntl": 25, "clone": 220, "prctl": 167}
# The same number on every architecture (the unified table, Linux >= 5.1).
_UNIFIED = {"io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428,
            "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
            "clone3": 435, "pidfd_getfd": 438, "mount_setattr": 442, "fchmodat2": 452, "setxattrat": 463,
            "removexattrat": 466}
SECCOMP_ARCHES = {"x86_64": (0xC000003E, {**_X86, **_UNIFIED}), "aarch64": (0xC00000B7, {**_GENERIC, **_UNIFIED})}
CLONE_THREAD = 0x00010000
# clone flags that make namespaces: refused even where subprocesses are allowed.
CLONE_NEW_ANY = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x80
AF_INET, AF_INET6 = 2, 10
# ioctls that change an inode's flags (FS_IOC_SETFLAGS, its 32-bit twin, FS_IOC_FSSETXATTR)
# and fcntl(F_SETLEASE): owner-only operations Landlock does not check.
SET_INODE_IOCTLS, F_SETLEASE = (0x40086602, 0x40046602, 0x401C5820), 1024
EPERM, EAGAIN, ENOSYS = 1, 11, 38
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
RET_ALLOW, RET_ERRNO, RET_KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000
LD_ABS, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _arg_block(nr: int, arg: int, rules: list, default: int) -> list:
    """``nr``'s check of the low 32 bits of argument ``arg`` (little-endian): the first of
    ``rules`` ((jump op, k, action)) that matches decides, else ``default``. Starts with a
    jump past itself when the syscall is not ``nr`` (the accumulator then still holds the
    number, which the next block compares)."""
    body = [(LD_ABS, 0, 0, 16 + 8 * arg)]
    for op, k, action in rules:
        body += [(op, 0, 1, k), (RET, 0, 0, action)]
    body.append((RET, 0, 0, default))
    return [(JEQ, 0, len(body), nr)] + body


def seccomp_filter(allow_subprocesses: bool, deny_truncate: bool) -> list:
    """The BPF program (a list of ``(code, jt, jf, k)``; jumps count instructions after
    the current one): a syscall of another ABI (32-bit, x32) kills the process; those of
    ``_DENY`` (and ``truncate`` where ``deny_truncate``) fail with EPERM; ``socket`` for any
    family but AF_INET/AF_INET6 fails with EPERM (Unix sockets would reach a host daemon's
    socket by path, even in a directory the code cannot list; ``socketpair`` stays);
    inode-flag ioctls, ``F_SETLEASE`` and ``prctl(PR_SET_PDEATHSIG)`` fail with EPERM;
    ``clone`` with a namespace flag fails with EPERM. Unless ``allow_subprocesses``: ``fork``, ``vfork`` and a ``clone``
    without ``CLONE_THREAD`` fail with EAGAIN (what a process limit gives) and ``clone3``
    with ENOSYS (its flags sit in memory a filter cannot read; glibc then falls back to
    ``clone`` for threads). Threads stay possible."""
    machine = os.uname().machine
    if machine not in SECCOMP_ARCHES:
        raise SetupError(f"seccomp filter: no syscall table for architecture {machine!r}")
    arch, nrs = SECCOMP_ARCHES[machine]
    eperm, eagain = RET_ERRNO | EPERM, RET_ERRNO | EAGAIN
    prog = [(LD_ABS, 0, 0, 4), (JEQ, 1, 0, arch), (RET, 0, 0, RET_KILL_PROCESS),
            (LD_ABS, 0, 0, 0), (JGE, 0, 1, 0x40000000), (RET, 0, 0, RET_KILL_PROCESS)]
    deny = [n for n in _DENY + list(_X86_ONLY if machine == "x86_64" else ()) if n not in ("fork", "vfork")]
    deny += ["truncate"] if deny_truncate else []
    for name in deny:
        prog += [(JEQ, 0, 1, nrs[name]), (RET, 0, 0, eperm)]
    if not allow_subprocesses:
        prog += [(JEQ, 0, 1, nrs["clone3"]), (RET, 0, 0, RET_ERRNO | ENOSYS)]
        for name in ("fork", "vfork"):
            if name in nrs:
                prog += [(JEQ, 0, 1, nrs[name]), (RET, 0, 0, eagain)]
    prog += _arg_block(nrs["socket"], 0, [(JEQ, AF_INET, RET_ALLOW), (JEQ, AF_INET6, RET_ALLOW)], eperm)
    prog += _arg_block(nrs["ioctl"], 1, [(JEQ, k, eperm) for k in SET_INODE_IOCTLS], RET_ALLOW)
    prog += _arg_block(nrs["fcntl"], 1, [(JEQ, F_SETLEASE, eperm)], RET_ALLOW)
    # PID 1 must keep its parent-death signal: cleared, it would outlive a killed trainer.
    prog += _arg_block(nrs["prctl"], 0, [(JEQ, PR_SET_PDEATHSIG, eperm)], RET_ALLOW)
    clone_rules = [(JSET, CLONE_NEW_ANY, eperm)]
    if not allow_subprocesses:
        clone_rules.append((JSET, CLONE_THREAD, RET_ALLOW))
    prog += _arg_block(nrs["clone"], 0, clone_rules, RET_ALLOW if allow_subprocesses else eagain)
    prog.append((RET, 0, 0, RET_ALLOW))
    return prog


def install_seccomp(prog: list) -> None:
    filters = (_SockFilter * len(prog))(*[_SockFilter(*ins) for ins in prog])
    fprog = _SockFprog(len(prog), filters)
    _check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "seccomp filter")


def drop_uid(uid: int) -> None:
    """Become ``uid`` (and gid ``uid``, no supplementary groups): a root trainer's files
    are then not the code's. Dumpable again afterwards, else ``/proc/self/uid_map`` stays
    root's and the user namespace cannot be mapped."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    _check(libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")


def new_namespaces(network: bool) -> None:
    """A user namespace (mapping our uid and gid to themselves), a mount namespace, a PID
    namespace and, when ``network``, a network namespace."""
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | (CLONE_NEWNET if network else 0)
    _check(libc.unshare(flags), "unshare(CLONE_NEWUSER|CLONE_NEWNS|CLONE_NEWPID"
           + ("|CLONE_NEWNET)" if network else ")"))
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"{uid} {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{gid} {gid} 1")


def mount_scratch(path: str, size_bytes: int) -> None:
    """A private tmpfs of ``size_bytes`` over ``path`` (in this mount namespace only), and
    cwd on it. First every mount of the namespace is made private, so nothing mounted
    here propagates to the host (a namespace owned by a new user namespace already gets
    slave copies; this does not rely on that)."""
    _check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount(/, MS_REC|MS_PRIVATE)")
    opts = f"size={size_bytes},nr_inodes={max(size_bytes >> 12, 1024)},mode=0700".encode()
    _check(libc.mount(b"tmpfs", path.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts),
           f"mount(tmpfs, {path}) (the scratch needs tmpfs mounts in user namespaces)")
    os.chdir(path)


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


def confine(s: dict, namespaces: bool, warnings: list, alive_r: "int | None") -> None:
    """Step 5 of the module docstring, in PID 1 (or the only process, without namespaces;
    ``alive_r``: the pipe whose EOF says the relay is gone)."""
    if namespaces:
        mount_scratch(s["write_root"], s["scratch_bytes"])
    # no_new_privs before Landlock and seccomp: they need it (or CAP_SYS_ADMIN, which the
    # fallback without a user namespace lacks).
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    abi = landlock_abi(s["landlock_abi_cap"])
    try:
        landlock(s["write_root"], s["read_roots"], abi)
    except SetupError as e:
        if not s["unsafe_no_landlock"]:
            raise
        abi = 0
        warnings.append(f"no Landlock ({e}): the code may read and write wherever its uid may")
    drop_capabilities()
    if alive_r is not None:
        # After the last change of credentials (one that changes the uid clears it) and
        # before the filter (which refuses it): PID 1 dies with the relay. A relay already
        # gone (killed before this line) shows as EOF on the pipe.
        _check(libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG) in PID 1")
        if select.select([alive_r], [], [], 0)[0]:
            os._exit(137)
        os.close(alive_r)
    install_seccomp(seccomp_filter(s["allow_subprocesses"], deny_truncate=abi < 3))
    set_limits(s)


def main() -> None:
    s = json.loads(sys.argv[1])
    status = s["status_fd"]

    def report(**msg) -> None:
        os.write(status, (json.dumps(msg) + "\n").encode())

    trainer = os.getppid()
    code = sys.stdin.read()
    devnull = os.open("/dev/null", os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    warnings = []
    try:
        if s["uid"] is not None:
            drop_uid(s["uid"])
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
                warnings.append("no PID or mount namespace: stray processes are killed by process group "
                                "only, and the scratch is a directory on the host's disk")
    except (SetupError, OSError) as e:
        report(ok=False, error=str(e))
        os._exit(1)
    if namespaces:
        alive_r, alive_w = os.pipe()  # PID 1 sees EOF here once the relay is gone
        pid = os.fork()
        if pid:  # the relay: report PID 1 (the parent waits for its end), relay its exit status
            os.close(alive_r)
            # The relay dies with the trainer's thread that started it (a killed trainer
            # leaves no sandbox behind), and PID 1 with the relay (below).
            _check(libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG) in the relay")
            if os.getppid() != trainer:
                os._exit(137)
            report(init_pid=pid)
            os.close(status)
            _, st = os.waitpid(pid, 0)
            os._exit(os.waitstatus_to_exitcode(st) if os.WIFEXITED(st) else 128 + os.WTERMSIG(st))
        os.close(alive_w)
    try:
        confine(s, namespaces, warnings, alive_r if namespaces else None)
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
