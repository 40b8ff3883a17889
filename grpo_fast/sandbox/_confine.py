"""How the sandbox confines a process: namespaces, a read-only root, no privileges, limits, filters.

The mechanisms the bootstrap (`_boot.py`) applies in order, each a thin layer over the system
calls it makes (through libc with ctypes: the standard library has no wrapper for most):
- `enter_namespaces`: new PID, network and IPC namespaces, as root or in a user namespace;
- `build_root`: a private mount namespace whose root is a read-only tree of the system and
  Python directories, a few device nodes, a fresh /proc and a size-capped tmpfs scratch;
- `switch_uid`, `drop_privileges`, `set_limits`: a uid of its own (as root), no capability,
  keyring or setuid gain, and the resource limits;
- the fallback's `install_seccomp` and Landlock (`landlock_ruleset`), where no namespace can be
  made (SECURITY.md says what each mode guarantees).
A failure raises `SetupError` naming its stage (`stage`) and errno (`describe`).
Only the standard library is used: the bootstrap imports this before anything else is importable.
"""

import ctypes
import errno
import os
import re
import resource
import signal
import struct
from contextlib import contextmanager

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
SANDBOX_NAMESPACES = CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 4, 22, 36, 38
# Host directories the sandbox sees read-only (besides the Python installation): what
# programs and the dynamic loader need. Home directories, /root, /var, /srv, /opt and the
# caller's working tree are not among them.
SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc")
# Where the new root is assembled (in the private mount namespace, hiding what is there):
# the first of these that exists and holds no Python directory, which must stay visible.
ROOT_MOUNT_POINTS = ("/mnt", "/media", "/srv", "/opt", "/boot", "/tmp")
DEVICES = ("null", "zero", "full", "random", "urandom")

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


def check(ret: int, what: str) -> int:
    """A system call's result, or OSError with its errno when it failed (returned < 0)."""
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def describe(exc: BaseException) -> str:
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
def stage(name: str, namespaces: bool = False):
    """Turns any failure inside into a SetupError naming this stage."""
    try:
        yield
    except SetupError:
        raise
    except BaseException as exc:  # noqa: BLE001 - whatever failed, the caller must learn where
        raise SetupError(f"{name}: {describe(exc)}", namespaces) from exc


def _mount(source, target: str, fstype, flags: int, data=None) -> None:
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


# ---------------------------------------------------------------- namespaces (this process)


def enter_namespaces(cfg: dict) -> tuple[str, str | None]:
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
            check(libc.unshare(SANDBOX_NAMESPACES), "unshare")
            return "root", None
        except OSError as exc:
            errors.append(f"as root: {describe(exc)}")
    try:
        # One call, so that a kernel that refuses any of them leaves this process unchanged.
        check(libc.unshare(CLONE_NEWUSER | SANDBOX_NAMESPACES), "unshare with a user namespace")
    except OSError as exc:
        errors.append(describe(exc))
        return "none", "; ".join(errors)
    # One uid and gid exist inside: the sandbox uid as root (which keeps groups usable, so
    # the child can drop its own), else the caller's own (which requires setgroups "deny").
    if cfg["uid"] is not None:
        uid = gid = cfg["uid"]
    with stage("user namespace: id maps", namespaces=True):
        if cfg["uid"] is None:
            with open("/proc/self/setgroups", "w") as f:
                f.write("deny")
        for name, ident in (("uid_map", uid), ("gid_map", gid)):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(f"{ident} {ident} 1")
    return "user", None


# ---------------------------------------------------------------- the child (inside the sandbox)


def build_root(cfg: dict, uid: int, gid: int) -> None:
    """A private mount namespace whose root is a read-only tree of what programs need, /tmp a tmpfs."""
    check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
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
    check(libc.syscall(SYSCALLS[os.uname().machine]["pivot_root"], b".", b"."), "pivot_root")
    check(libc.umount2(b".", MNT_DETACH), "umount the old root")  # it was stacked on the new one
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


def switch_uid(cfg: dict) -> None:
    """A root caller's sandbox gets a uid of its own and no supplementary groups."""
    if cfg["uid"] is not None:
        os.setgroups([])
        os.setresgid(cfg["uid"], cfg["uid"], cfg["uid"])
        os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])


def drop_privileges() -> None:
    """Every capability (inside a user namespace a uid change alone does not clear them), the
    caller's keyring, any gain from setuid binaries; and the child dies with this bootstrap."""
    # A new, empty session keyring: the one inherited from the caller may hold its keys.
    # Where keyctl itself is refused (a container's seccomp profile, such as Docker's
    # default, denies it), the program inherits that refusal and cannot reach any keyring.
    try:
        check(
            libc.syscall(SYSCALLS[os.uname().machine]["keyctl"], KEYCTL_JOIN_SESSION_KEYRING, None),
            "keyctl(JOIN_SESSION_KEYRING)",
        )
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOSYS):
            raise
    header, data = _CapHeader(0x20080522, 0), (_CapData * 2)()
    check(libc.capset(ctypes.byref(header), data), "capset")
    check(libc.capget(ctypes.byref(header), data), "capget")
    if any(d.effective or d.permitted or d.inheritable for d in data):
        raise OSError("capabilities are still held after capset")
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")  # no setuid binaries
    # Set after the uid change, which clears it: the child dies with this bootstrap.
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")


def set_limits(limits: dict, per_process_memory: int) -> None:
    cpu = limits["cpu_time_s"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (per_process_memory,) * 2)
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["max_processes"],) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["output_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits["open_files"],) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def install_seccomp(arch: int, denied: tuple[int, ...]) -> None:
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
    check(libc.prctl(PR_SET_SECCOMP, 2, ctypes.byref(prog), 0, 0), "prctl(PR_SET_SECCOMP)")


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 where there is none."""
    return max(libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, 0, 1), 0)  # LANDLOCK_CREATE_RULESET_VERSION


def landlock_ruleset(cfg: dict, scratch: str, abi: int) -> int:
    """The fallback's file-access rules (see SYS_LANDLOCK_*), made while the paths can still be opened."""
    handled = (1 << {1: 13, 2: 14, 3: 15, 4: 15}.get(abi, 16)) - 1  # the access rights this ABI knows
    ruleset = check(
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
            check(
                libc.syscall(SYS_LANDLOCK_ADD_RULE, ruleset, 1, struct.pack("=Qi", access & handled, fd), 0),
                f"landlock_add_rule {path}",
            )
        finally:
            os.close(fd)
    return ruleset
