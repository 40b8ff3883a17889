"""Sandbox bootstrap: started by `sandbox.py` as `python -I -S -c "...; _sandbox_boot.main()"`.

Protocol: fd 0 carries length-prefixed JSON messages from the caller: the run's
configuration, then (for judged runs) the tests, which are read only after the sandboxed
child has been forked, so that they never exist in its memory. fd 1 carries status lines
back: `{"started": ...}` once the sandbox is set up, then the final status. The program's
stdout and stderr go to two memfds passed by the caller.

The bootstrap:
  1. enters new PID, network and IPC namespaces: directly as root, else inside a new user
     namespace (any user, where the kernel allows it); where neither works, the fallback
     (see SECURITY.md), which the caller may refuse;
  2. forks the child, PID 1 of the new PID namespace. The child builds a private mount
     namespace whose root is a small read-only tree (the system directories, the Python
     installation, a few device nodes, a fresh /proc) with a size-capped tmpfs at /tmp,
     /var/tmp and /dev/shm; drops every privilege (uid, groups, capabilities,
     no_new_privs); sets the resource limits; and runs the program in the interpreter it
     inherited from this process (no second interpreter start);
  3. meanwhile judges (for code_reward's tests: `_code_harness.judge`) or waits, kills the
     child at the deadline, and reports. When PID 1 of a namespace dies the kernel kills
     every other process in it: nothing the program started survives. In the fallback this
     process is the child subreaper and kills every descendant itself.
Only the standard library is used: this module runs before anything else is importable.
"""

import atexit
import ctypes
import errno
import json
import os
import re
import resource
import signal
import struct
import sys
import time
from contextlib import contextmanager

import _code_harness

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
SANDBOX_NAMESPACES = CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 4, 22, 36, 38
SETUP_FAILED = 121
# Host directories the sandbox sees read-only (besides the Python installation): what
# programs and the dynamic loader need. Home directories, /root, /var, /srv, /opt and the
# caller's working tree are not among them.
SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc")
# Where the new root is assembled (in the private mount namespace, hiding what is there):
# the first of these that exists and holds no Python directory, which must stay visible.
ROOT_MOUNT_POINTS = ("/mnt", "/media", "/srv", "/opt", "/boot", "/tmp")
DEVICES = ("null", "zero", "full", "random", "urandom")
# Sandboxed numeric libraries get one thread each: their default of one per core would
# use up the process cap and the memory split across it.
SANDBOX_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
# The fallback's scratch dir is a plain host directory: its total size is checked this
# often (and the files counted, so that the check stays cheap), killing the sandbox when over.
FALLBACK_POLL_S = 0.01
FALLBACK_MAX_FILES = 10_000

# System calls without a glibc wrapper (pivot_root has one only from 2.36), by architecture.
SYSCALLS = {
    "x86_64": {"pivot_root": 155, "keyctl": 250},
    "aarch64": {"pivot_root": 41, "keyctl": 219},
    "riscv64": {"pivot_root": 41, "keyctl": 219},
    "ppc64le": {"pivot_root": 203, "keyctl": 355},
    "s390x": {"pivot_root": 217, "keyctl": 280},
}
KEYCTL_JOIN_SESSION_KEYRING = 1
# The fallback's seccomp filter: per architecture, the audit arch and the system calls the
# program may not make. Without namespaces the program shares the machine's PID and network
# namespaces (and, for a non-root caller, its uid): it may not signal or trace any process
# (this bootstrap, the trainer), open sockets (socketpair stays: it reaches nothing), nor
# reach the kernel keyring, BPF, perf or userfaultfd; io_uring could open sockets. Nor may
# it change files' modes, owners, times or extended attributes, which Landlock leaves open.
SECCOMP_DENIED = {
    "x86_64": (
        0xC000003E,
        (
            41,
            62,
            200,
            234,
            129,
            297,
            424,
            434,
            438,  # socket, kill, tkill, tgkill, rt_(tg)sigqueueinfo, pidfd_*
            101,
            310,
            311,
            425,
            250,
            248,
            249,
            321,
            298,
            323,  # ptrace, process_vm_*, io_uring_setup, keys, bpf, ...
            90,
            91,
            268,
            452,
            92,
            93,
            94,
            260,  # chmod, fchmod, fchmodat(2), chown, fchown, lchown, fchownat
            132,
            235,
            261,
            280,
            188,
            189,
            190,
            197,
            198,
            199,
            463,
            466,
        ),
    ),  # utime(s), ..., (l/f)set/removexattr(at)
    "aarch64": (
        0xC00000B7,
        (  # the same calls (aarch64 has only the *at forms of chmod, chown, utime)
            198,
            129,
            130,
            131,
            138,
            240,
            424,
            434,
            438,
            117,
            270,
            271,
            425,
            219,
            217,
            218,
            280,
            241,
            282,
            52,
            53,
            452,
            54,
            55,
            88,
            5,
            6,
            7,
            14,
            15,
            16,
            463,
            466,
        ),
    ),
}
X32_SYSCALL_BIT = 0x40000000
# Landlock (Linux 5.13+; the same system call numbers on every architecture): where it is
# available the fallback confines the program's file access to the view the namespaces
# give (read the system and Python directories, use the device nodes, anything in the
# scratch dir; no /proc, no home, no other temporary directory).
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_READ = 1 | 4 | 8  # EXECUTE, READ_FILE, READ_DIR
LANDLOCK_DEVICE = 2 | 4 | (1 << 14)  # WRITE_FILE, READ_FILE, TRUNCATE (open(..., "w"))

libc = ctypes.CDLL(None, use_errno=True)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]


def _check(ret: int, what: str) -> int:
    """A system call's result, or OSError with its errno when it failed (returned < 0)."""
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def _describe(exc: BaseException) -> str:
    """An exception as one line that names its errno, e.g. "PermissionError: [Errno 1 EPERM] ..."."""
    if isinstance(exc, OSError) and exc.errno is not None:
        where = f" ({exc.filename})" if exc.filename is not None else ""
        return f"{type(exc).__name__}: [Errno {exc.errno} {errno.errorcode.get(exc.errno, '?')}] {exc.strerror}{where}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class SetupError(Exception):
    """A stage of the sandbox's set-up failed, before the program ran: the message names the stage and the errno.

    namespaces: the namespaces were made but cannot be used here (their id maps or mounts were
    refused: a kernel or AppArmor policy); the caller then runs the fallback instead.
    """

    def __init__(self, message: str, namespaces: bool = False):
        super().__init__(message)
        self.namespaces = namespaces


@contextmanager
def _stage(name: str, namespaces: bool = False):
    """Turns any failure inside into a SetupError naming this stage."""
    try:
        yield
    except SetupError:
        raise
    except BaseException as exc:  # noqa: BLE001 - whatever failed, the caller must learn where
        raise SetupError(f"{name}: {_describe(exc)}", namespaces) from exc


def _mount(source, target: str, fstype, flags: int, data=None) -> None:
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    _check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def _read_message(fd: int) -> dict:
    """One length-prefixed JSON message, read exactly: nothing after it enters this process."""
    header = _read_exactly(fd, 12)
    return json.loads(_read_exactly(fd, int(header)))


def _read_exactly(fd: int, n: int) -> bytes:
    chunks = []
    while n:
        chunk = os.read(fd, n)
        if not chunk:
            raise EOFError("the caller closed the configuration pipe early")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _report(status: dict) -> None:
    os.write(1, (json.dumps(status) + "\n").encode())


# ---------------------------------------------------------------- namespaces (this process)


def _enter_namespaces(cfg: dict) -> tuple[str, str | None]:
    """Returns "root" or "user" (the namespaces made), or "none" and why none could be.

    Raises SetupError(namespaces=True) where a user namespace was made but cannot be used (its
    id maps refused): this process is then in it for good, and the caller runs the fallback instead.
    """
    if cfg["namespaces_refused"] is not None:
        return "none", cfg["namespaces_refused"]
    errors = []
    # The caller's ids, read before the unshare: inside a new user namespace they read as the
    # overflow id (65534) until the maps are written, and only the nobody account may map that.
    uid, gid = os.geteuid(), os.getegid()
    if uid == 0:
        try:
            _check(libc.unshare(SANDBOX_NAMESPACES), "unshare")
            return "root", None
        except OSError as exc:
            errors.append(f"as root: {_describe(exc)}")
    try:
        # One call, so that a kernel that refuses any of them leaves this process unchanged.
        _check(libc.unshare(CLONE_NEWUSER | SANDBOX_NAMESPACES), "unshare with a user namespace")
    except OSError as exc:
        errors.append(_describe(exc))
        return "none", "; ".join(errors)
    # One uid and gid exist inside: the sandbox uid as root (which keeps groups usable, so
    # the child can drop its own), else the caller's own (which requires setgroups "deny").
    if cfg["uid"] is not None:
        uid = gid = cfg["uid"]
    with _stage("user namespace: id maps", namespaces=True):
        if cfg["uid"] is None:
            with open("/proc/self/setgroups", "w") as f:
                f.write("deny")
        for name, ident in (("uid_map", uid), ("gid_map", gid)):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(f"{ident} {ident} 1")
    return "user", None


# ---------------------------------------------------------------- the child (inside the sandbox)


def _build_root(cfg: dict, uid: int, gid: int) -> None:
    """A private mount namespace whose root is a read-only tree of what programs need, /tmp a tmpfs."""
    _check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the host
    free = [
        d
        for d in ROOT_MOUNT_POINTS
        if os.path.isdir(d)
        and not os.path.islink(d)
        and not any((p + "/").startswith(d + "/") for p in cfg["python_dirs"])
    ]
    if not free:
        raise OSError(f"no mount point for the sandbox's root: each of {ROOT_MOUNT_POINTS} is missing or holds Python")
    root = free[0]
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    bound = []

    def bind(path):
        target = root + path
        os.makedirs(target, 0o755, exist_ok=True)
        _mount(path, target, None, MS_BIND | MS_REC)
        bound.append(path + "/")

    for name in SYSTEM_DIRS:
        host = "/" + name
        if os.path.islink(host):
            os.symlink(os.readlink(host), root + host)
        elif os.path.isdir(host):
            bind(host)
    for path in cfg["python_dirs"]:  # the interpreter may live under /root or a home directory
        if os.path.isdir(path) and not any((path + "/").startswith(b) for b in bound):
            bind(path)
    os.mkdir(root + "/dev", 0o755)
    for name in DEVICES:
        open(f"{root}/dev/{name}", "w").close()
        _mount(f"/dev/{name}", f"{root}/dev/{name}", None, MS_BIND)
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        os.symlink(target, f"{root}/dev/{name}")
    for path in ("/proc", "/tmp", "/var/tmp", "/dev/shm"):
        os.makedirs(root + path, 0o755, exist_ok=True)
    # A fresh /proc shows only this PID namespace; the kernel allows it only while a full
    # /proc is still visible, so before the pivot. Where it refuses (a container that masks
    # parts of its /proc), the sandbox gets an empty /proc rather than the host's.
    try:
        _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError:
        pass
    _make_readonly(root)
    os.chdir(root)
    _check(libc.syscall(SYSCALLS[os.uname().machine]["pivot_root"], b".", b"."), "pivot_root")
    _check(libc.umount2(b".", MNT_DETACH), "umount the old root")  # it was stacked on the new one
    os.chdir("/")
    _mount(
        "tmpfs",
        "/tmp",
        "tmpfs",
        MS_NOSUID | MS_NODEV,
        f"size={cfg['limits']['scratch_bytes']},mode=0700,uid={uid},gid={gid}",
    )
    for path in ("/var/tmp", "/dev/shm"):  # one size cap for every writable directory
        _mount("/tmp", path, None, MS_BIND)
    os.chdir("/tmp")


def _make_readonly(root: str) -> None:
    """Remount the mount at `root` and every mount on it read-only, keeping the flags the kernel locks."""
    with open("/proc/self/mountinfo") as f:
        mounts = [
            (fields[0], fields[1], re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4]))
            for fields in map(str.split, f)
        ]
    # By mount id, not by path: host mounts below `root`'s path are hidden under it, not in it.
    inside = {[mount_id for mount_id, _, point in mounts if point == root][-1]}
    while True:
        grown = inside | {mount_id for mount_id, parent, _ in mounts if parent in inside}
        if grown == inside:
            break
        inside = grown
    for mount_id, _, point in mounts:
        if mount_id in inside:
            locked = os.statvfs(point).f_flag & (MS_NOSUID | MS_NODEV | MS_NOEXEC)  # ST_* == MS_* for these
            _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | locked)


def _switch_uid(cfg: dict) -> None:
    """A root caller's sandbox gets a uid of its own and no supplementary groups."""
    if cfg["uid"] is not None:
        os.setgroups([])
        os.setresgid(cfg["uid"], cfg["uid"], cfg["uid"])
        os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])


def _drop_privileges() -> None:
    """Every capability (inside a user namespace a uid change alone does not clear them), the
    caller's keyring, any gain from setuid binaries; and the child dies with this bootstrap."""
    # A new, empty session keyring: the one inherited from the caller may hold its keys.
    # Where keyctl itself is refused (a container's seccomp profile, such as Docker's
    # default, denies it), the program inherits that refusal and cannot reach any keyring.
    try:
        _check(
            libc.syscall(SYSCALLS[os.uname().machine]["keyctl"], KEYCTL_JOIN_SESSION_KEYRING, None),
            "keyctl(JOIN_SESSION_KEYRING)",
        )
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOSYS):
            raise
    header, data = _CapHeader(0x20080522, 0), (_CapData * 2)()
    _check(libc.capset(ctypes.byref(header), data), "capset")
    _check(libc.capget(ctypes.byref(header), data), "capget")
    if any(d.effective or d.permitted or d.inheritable for d in data):
        raise OSError("capabilities are still held after capset")
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")  # no setuid binaries
    # Set after the uid change, which clears it: the child dies with this bootstrap.
    _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")


def _set_limits(limits: dict, per_process_memory: int) -> None:
    cpu = limits["cpu_time_s"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (per_process_memory,) * 2)
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["max_processes"],) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["output_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits["open_files"],) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _install_seccomp(arch: int, denied: tuple[int, ...]) -> None:
    """A system-call filter that fails each `denied` call (numbers of audit architecture `arch`)
    with EPERM, and every call of another architecture (the fallback's: SECCOMP_DENIED)."""
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    allow, deny = 0x7FFF0000, 0x00050000 | 1  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | EPERM
    tests = [(jge, X32_SYSCALL_BIT)] * (arch == 0xC000003E) + [(jeq, nr) for nr in denied]
    program = [(ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, deny), (ld, 0, 0, 0)]
    program += [(code, len(tests) - i, 0, k) for i, (code, k) in enumerate(tests)]
    program += [(ret, 0, 0, allow), (ret, 0, 0, deny)]
    raw = b"".join(struct.pack("HBBI", *insn) for insn in program)
    prog = _SockFprog(len(program), raw)
    _check(libc.prctl(PR_SET_SECCOMP, 2, ctypes.byref(prog), 0, 0), "prctl(PR_SET_SECCOMP)")


def _landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 where there is none."""
    return max(libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, 0, 1), 0)  # LANDLOCK_CREATE_RULESET_VERSION


def _landlock_ruleset(cfg: dict, scratch: str, abi: int) -> int:
    """The fallback's file-access rules (see SYS_LANDLOCK_*), made while the paths can still be opened."""
    handled = (1 << {1: 13, 2: 14, 3: 15, 4: 15}.get(abi, 16)) - 1  # the access rights this ABI knows
    ruleset = _check(
        libc.syscall(SYS_LANDLOCK_CREATE_RULESET, struct.pack("=Q", handled), 8, 0), "landlock_create_ruleset"
    )
    rules = [("/" + name, LANDLOCK_READ) for name in SYSTEM_DIRS] + [(p, LANDLOCK_READ) for p in cfg["python_dirs"]]
    rules += [(f"/dev/{name}", LANDLOCK_DEVICE) for name in DEVICES] + [(scratch, handled)]
    for path, access in rules:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            _check(
                libc.syscall(SYS_LANDLOCK_ADD_RULE, ruleset, 1, struct.pack("=Qi", access & handled, fd), 0),
                f"landlock_add_rule {path}",
            )
        finally:
            os.close(fd)
    return ruleset


def _child(cfg: dict, isolation: str, scratch: str | None, setup_pipe: int, channel) -> None:
    """The forked child: set up the sandbox, then run the program. Never returns."""
    try:
        _set_up_child(cfg, isolation, scratch)
    except BaseException as exc:  # noqa: BLE001 - any failure must reach the parent
        if not isinstance(exc, SetupError):
            exc = SetupError(f"sandbox set-up: {_describe(exc)}")
        os.write(setup_pipe, json.dumps({"error": str(exc)[:4000], "namespaces": exc.namespaces}).encode())
        os._exit(SETUP_FAILED)
    os.close(setup_pipe)  # set up: from here on, whatever happens is the program's doing
    main_module = type(sys)("__main__")
    sys.modules["__main__"] = main_module  # pickle (multiprocessing) finds the program's functions
    sys.argv = ["-c", *cfg["args"]]
    try:
        if channel is not None:
            _code_harness.serve(cfg["setup"], cfg["program"], *channel)
        else:
            exec(compile(cfg["program"], "<string>", "exec"), main_module.__dict__)
        code = 0
    except SystemExit as exc:  # what the interpreter makes of sys.exit(code)
        code = exc.code if exc.code is None or isinstance(exc.code, int) else 1
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported as the interpreter would
        sys.excepthook(*sys.exc_info())
        code = 1
    _exit(code or 0)


def _set_up_child(cfg: dict, isolation: str, scratch: str | None) -> None:
    """Everything between the fork and the program, each stage named for the error it may raise."""
    with _stage("new session"):
        # A session and process group of its own: kill(0, ...) and killpg(getpgrp(), ...)
        # then reach only the sandbox, never this bootstrap (which, in a user namespace, runs
        # under the same uid and so may be signalled by it otherwise).
        os.setsid()
    if cfg["cgroup"] is not None:
        with _stage("cgroup"), open(os.path.join(cfg["cgroup"], "cgroup.procs"), "w") as f:
            f.write("0")  # this process, before it can start any other
    with _stage("standard streams"):
        stdin = os.memfd_create("stdin")
        os.write(stdin, cfg["stdin"].encode())
        os.lseek(stdin, 0, os.SEEK_SET)
        for fd, target in ((stdin, 0), (cfg["stdout_fd"], 1), (cfg["stderr_fd"], 2)):
            os.dup2(fd, target)  # replaces the configuration and status pipes of this process
            os.close(fd)
    uid = cfg["uid"] if cfg["uid"] is not None else os.geteuid()
    gid = cfg["uid"] if cfg["uid"] is not None else os.getegid()
    # The mounts need root's capabilities as root (a uid change drops them), and the
    # namespace's own uid inside a user namespace (files made by an unmapped uid fail).
    if isolation == "root":
        with _stage("private root (mount namespace)", namespaces=True):
            _build_root(cfg, uid, gid)
    if isolation == "landlock":  # opened with the caller's rights: the sandbox uid may not reach them all
        with _stage("landlock rules"):
            ruleset = _landlock_ruleset(cfg, scratch, _landlock_abi())
    with _stage("switch to the sandbox uid"):
        _switch_uid(cfg)
    if isolation == "user":
        with _stage("private root (mount namespace)", namespaces=True):
            _build_root(cfg, uid, gid)
    with _stage("drop privileges"):
        if scratch is not None:
            os.chdir(scratch)
        _drop_privileges()
    with _stage("write the program's files"):
        for name, text in cfg["files"].items():
            with open(name, "w") as f:
                f.write(text)
    with _stage("resource limits"):
        _set_limits(cfg["limits"], cfg["process_memory_bytes"])
    if isolation == "landlock":
        with _stage("landlock"):
            _check(libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0), "landlock_restrict_self")
            os.close(ruleset)
    if isolation in ("landlock", "none"):
        with _stage("seccomp filter"):
            _install_seccomp(*SECCOMP_DENIED[os.uname().machine])
    os.environ.clear()
    os.environ.update(SANDBOX_ENV, HOME=os.getcwd())
    sys.stdin = sys.__stdin__ = open(0, encoding="utf-8", errors="surrogateescape", closefd=False)
    sys.stdout = sys.__stdout__ = open(1, "w", encoding="utf-8", errors="surrogateescape", closefd=False)
    sys.stderr = sys.__stderr__ = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False, buffering=1)


def _exit(code: int) -> None:
    """The interpreter's own shutdown (non-daemon threads, atexit hooks, flushed output)
    without its teardown of every module, which takes longer than a small program."""
    if "threading" in sys.modules:
        sys.modules["threading"]._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a full or closed stream: what was written stays
            pass
    os._exit(code & 0xFF)


# ---------------------------------------------------------------- this process (outside the sandbox)


class _Sandbox:
    """Kills the sandbox: PID 1 of its namespace, or in the fallback (which has a host scratch
    dir, None with namespaces) every descendant of this process."""

    def __init__(self, pid: int, scratch: str | None, scratch_bytes: int):
        self.pid, self.scratch, self.scratch_bytes = pid, scratch, scratch_bytes
        self.timed_out = False

    def kill(self) -> None:
        if self.scratch is None:
            try:
                os.kill(self.pid, signal.SIGKILL)  # the kernel kills the rest of its namespace
            except ProcessLookupError:
                pass
            return
        with open(f"/proc/self/task/{os.getpid()}/children") as f:  # this process has one thread
            for pid in f.read().split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def on_alarm(self, deadline: float) -> None:
        """SIGALRM: at the deadline (and, in the fallback, every FALLBACK_POLL_S for the scratch size)."""
        if self.scratch is None or time.monotonic() >= deadline:
            self.timed_out = True
            self.kill()
        elif self._scratch_over():
            self.kill()

    def _scratch_over(self) -> bool:
        used, files, stack = 0, 0, [self.scratch]
        while stack:
            try:
                entries = list(os.scandir(stack.pop()))
            except OSError:
                continue
            for entry in entries:
                files += 1
                try:
                    used += entry.stat(follow_symlinks=False).st_blocks * 512
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
                except OSError:
                    continue
            if used > self.scratch_bytes or files > FALLBACK_MAX_FILES:
                return True
        return False

    def reap(self) -> int:
        """Waits for the child and, in the fallback, kills and reaps every other descendant; returns its status."""
        os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)  # its pid stays ours until the deadline is off
        signal.setitimer(signal.ITIMER_REAL, 0)
        _, status = os.waitpid(self.pid, 0)
        if self.scratch is not None:
            while True:
                self.kill()
                try:
                    pid, _ = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    time.sleep(0.001)
        return status


def _remove_tree(path: str) -> None:
    """Deletes the fallback's scratch dir, also what the program made unreadable or nested deeply in it."""
    stack, dirs = [path], []
    while stack:
        current = stack.pop()
        os.chmod(current, 0o700)  # the program may have taken away our right to list or delete
        dirs.append(current)
        for entry in os.scandir(current):
            if entry.is_dir(follow_symlinks=False):
                stack.append(entry.path)
            else:
                os.unlink(entry.path)
    for current in reversed(dirs):
        os.rmdir(current)


def _make_cgroup(cfg: dict) -> str | None:
    """A cgroup of its own under the caller's delegated cgroup v2 parent: one memory and process budget."""
    if cfg["cgroup_parent"] is None:
        return None
    path = os.path.join(cfg["cgroup_parent"], f"grpo_fast_sandbox_{os.getpid()}")
    os.mkdir(path)
    limits = cfg["limits"]
    for name, value in (
        ("memory.max", limits["memory_bytes"]),
        ("memory.swap.max", 0),
        ("pids.max", limits["max_processes"]),
    ):
        with open(os.path.join(path, name), "w") as f:
            f.write(str(value))
    return path


def _remove_cgroup(path: str) -> None:
    """rmdir of a cgroup fails while the kernel still accounts its last, already dead tasks."""
    for _ in range(100):
        try:
            os.rmdir(path)
            return
        except OSError:
            time.sleep(0.001)
    os.rmdir(path)


def _prepare(cfg: dict) -> tuple[str, str | None, str | None]:
    """Namespaces (or the fallback), this process made non-dumpable, the fallback's scratch
    dir and the cgroup; returns (isolation, why no namespaces, scratch dir or None)."""
    if os.uname().machine not in SYSCALLS:
        raise SetupError(f"system-call table: none for {os.uname().machine}")
    isolation, reason = _enter_namespaces(cfg)
    with _stage("prctl(PR_SET_DUMPABLE)"):
        # Not dumpable (set after the uid maps, which a non-dumpable process cannot write): in
        # the fallback the program may run under this uid, and must not read this process's
        # memory or open its file descriptors (the tests wait in the configuration pipe) via /proc.
        _check(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")
    if isolation == "none" and cfg["require_isolation"]:
        raise SetupError(f"isolation is required but no namespace is available ({reason})")
    scratch = None
    if isolation == "none":
        if os.uname().machine not in SECCOMP_DENIED:
            raise SetupError(
                f"the fallback ({reason}) needs a seccomp filter, which has no table for {os.uname().machine}"
            )
        with _stage("fallback scratch dir"):
            _check(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(CHILD_SUBREAPER)")
            scratch = os.path.join(cfg["tmpdir"], f"grpo_fast_sandbox_{os.getpid()}")
            os.mkdir(scratch, 0o700)
            if cfg["uid"] is not None:
                os.chown(scratch, cfg["uid"], cfg["uid"])
        if _landlock_abi():
            isolation = "landlock"
    with _stage("cgroup"):
        cfg["cgroup"] = _make_cgroup(cfg)
    return isolation, reason, scratch


def main() -> None:
    """Sets the sandbox up, runs the program, judges it and reports (see the module docstring).

    Every failure before the program runs is reported as {"setup_error": "<stage>: <error with
    its errno>", "namespaces": bool}; {"forked": ...} says the program may have run, so that a
    bootstrap that dies after it (whatever killed it) scores the run, never fails the call.
    """
    try:
        with _stage("configuration"):
            cfg = _read_message(0)
        sys.path += cfg["site_packages"]  # importable for the program and for the tests, without .pth hooks
        isolation, reason, scratch = _prepare(cfg)
        judged = cfg["setup"] is not None
        with _stage("fork"):
            setup_read, setup_write = os.pipe()
            if judged:
                requests_read, requests_write = os.pipe()
                replies_read, replies_write = os.pipe()
            pid = os.fork()
    except SetupError as exc:
        _report({"setup_error": str(exc), "namespaces": exc.namespaces})
        return
    if pid == 0:
        os.close(setup_read)
        channel = None
        if judged:
            os.close(requests_write)
            os.close(replies_read)
            channel = (requests_read, replies_write)
        _child(cfg, isolation, scratch, setup_write, channel)
    _report({"forked": True, "isolation": isolation, "reason": reason})
    for fd in (setup_write, cfg["stdout_fd"], cfg["stderr_fd"]) + ((requests_read, replies_write) if judged else ()):
        os.close(fd)
    tests = _read_message(0) if judged else None
    with os.fdopen(setup_read, "rb") as pipe:
        failure = json.loads(pipe.read() or "null")
    sandbox = _Sandbox(pid, scratch, cfg["limits"]["scratch_bytes"])
    start = time.monotonic()
    deadline = start + cfg["limits"]["wall_time_s"]
    passed = judge_error = None
    if failure is None:
        _report({"started": True, "isolation": isolation, "reason": reason})
        signal.signal(signal.SIGALRM, lambda signum, frame: sandbox.on_alarm(deadline))
        if scratch is None:
            signal.setitimer(signal.ITIMER_REAL, cfg["limits"]["wall_time_s"])
        else:
            signal.setitimer(signal.ITIMER_REAL, FALLBACK_POLL_S, FALLBACK_POLL_S)
        if judged:
            sys.stdout = open(os.devnull, "w")  # the tests may print; fd 1 carries the status
            channel = _code_harness.Channel(requests_write, replies_read, deadline, cfg["limits"]["output_bytes"])
            try:
                passed = _code_harness.judge(tests, channel)
            except Exception as exc:  # noqa: BLE001 - the trusted tests themselves are broken: say so
                judge_error = _describe(exc)
            sandbox.kill()  # the verdict is in; the program has nothing left to do
    status = sandbox.reap()
    if scratch is not None:
        _remove_tree(scratch)
    if cfg["cgroup"] is not None:
        _remove_cgroup(cfg["cgroup"])
    _report(
        {
            "isolation": isolation,
            "setup_error": failure and failure["error"],
            "namespaces": bool(failure and failure["namespaces"]),
            "timed_out": sandbox.timed_out,
            "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
            "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
            "wall_s": time.monotonic() - start,
            "passed": passed,
            "judge_error": judge_error,
        }
    )
