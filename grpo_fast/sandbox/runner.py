"""The caller's side of the sandbox: its limits, its result, and the run of one bootstrap.

`run_python(program, files=..., stdin=...)` starts `_boot.py` in a new session,
which puts the program in new PID, network, IPC and mount namespaces (as root directly,
otherwise inside an unprivileged user namespace), with a read-only view of the system,
a size-capped tmpfs scratch dir, resource limits, no privileges and a wall-clock limit.
Where the kernel allows no namespace it falls back to a weaker mode (a warning, once; or
`require_isolation=True` refuses). SECURITY.md states the threat model and what each mode
guarantees. Only the standard library is used.
"""

import functools
import json
import math
import os
import signal
import site
import subprocess
import sys
import tempfile
import threading
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace

_HERE = os.path.dirname(os.path.abspath(__file__))
# The bootstrap is imported as a module (so its bytecode is cached) from this directory,
# which is taken off sys.path again before any program runs: a program's imports must find
# its own modules and the standard library's, never the sandbox's (`import runner`, say).
_BOOT_COMMAND = f"import sys; sys.path.insert(0, {_HERE!r}); import _boot; del sys.path[0]; _boot.main()"
# A root caller runs each sandbox as uid UID_BASE + slot, the slot unique among this
# process's concurrent runs: a uid that owns no file and no other process, so that
# RLIMIT_NPROC counts only that sandbox's processes and it can signal no one. Separate
# Python processes on one machine share slots; give each its own base if that matters.
UID_BASE = int(os.environ.get("GRPO_FAST_SANDBOX_UID_BASE", "64000"))
# The smallest address space a Python process of the sandbox gets (see SandboxLimits).
MIN_PROCESS_MEMORY = 32 << 20
_slot_lock = threading.Lock()
_busy_slots: set[int] = set()
# Time the bootstrap itself may take (interpreter start, namespaces, tests) beyond the
# wall limit before the caller kills its whole session as a backstop.
_BOOT_GRACE_S = 10.0
_warned_fallback = threading.Event()
# Why the namespaces proved unusable in this process (made, but their id maps or mounts
# refused), after which every run takes the fallback; None while they work.
_namespaces_refused: str | None = None


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one run, for the program and all the processes it starts. Every field must be positive.

    wall_time_s:   wall-clock seconds from the start of the program to SIGKILL of all of them.
    cpu_time_s:    CPU seconds per process (RLIMIT_CPU); None = ceil(wall_time_s).
    memory_bytes:  memory of all the sandbox's processes together. With a cgroup v2 (see
                   SECURITY.md) that is its memory.max; without one, each process gets an
                   address space (RLIMIT_AS) of memory_bytes / max_processes, so that the
                   total cannot exceed it either. That share must be at least 32 MiB.
    max_processes: processes and threads of the sandbox together (RLIMIT_NPROC in its own
                   uid or user namespace; pids.max with a cgroup).
    output_bytes:  largest stdout, stderr or file it may write (writes beyond fail), and
                   largest value one of its functions may return to the tests.
    open_files:    file descriptors per process (RLIMIT_NOFILE).
    scratch_bytes: total size of its writable scratch dir (/tmp, also /var/tmp, /dev/shm).
    """

    wall_time_s: float = 4.0
    cpu_time_s: int | None = None
    memory_bytes: int = 2 << 30
    max_processes: int = 8
    output_bytes: int = 1 << 20
    open_files: int = 64
    scratch_bytes: int = 64 << 20

    def __post_init__(self):
        for name, value in asdict(self).items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"SandboxLimits.{name} must be a positive number, got {value!r}")
        if self.memory_bytes // self.max_processes < MIN_PROCESS_MEMORY:
            raise ValueError(
                f"SandboxLimits.memory_bytes / max_processes must be at least {MIN_PROCESS_MEMORY} "
                f"(each process's share without a cgroup), got {self.memory_bytes} / "
                f"{self.max_processes}"
            )


@dataclass(frozen=True)
class SandboxResult:
    """What one run produced. `ok` is True when it exited with status 0 before the deadline."""

    stdout: str
    stderr: str
    exit_code: int | None  # None when killed by a signal
    signal: int | None  # e.g. 9 (SIGKILL) at the deadline
    timed_out: bool
    isolation: str  # "root" or "user" (namespaces); the fallback: "landlock" or "none" (see SECURITY.md)
    wall_s: float
    error: str | None = None  # the sandbox could not start the program, or the tests could not run
    passed: int | None = None  # run_judged: how many tests the judge counted as passed

    @property
    def isolated(self) -> bool:
        return self.isolation in ("root", "user")

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and self.error is None


def run_python(
    program: str,
    *,
    files: dict[str, str] | None = None,
    stdin: str = "",
    args: tuple[str, ...] = (),
    limits: SandboxLimits | None = None,
    require_isolation: bool = False,
) -> SandboxResult:
    """Run `program` as `__main__` in the sandbox (like `python -I -S -c program *args`) and wait for it.

    The interpreter is this process's, started afresh; installed packages are importable
    (site-packages is on sys.path), but `.pth` hooks do not run, so editable installs are not.

    program: Python source, run with a fresh scratch directory as cwd (/tmp with namespaces).
    files:   {plain file name: text} written into the scratch directory first.
    stdin:   text fed to the program's stdin.
    require_isolation: raise RuntimeError instead of running in the fallback (no namespaces).
    Thread-safe: concurrent calls run in parallel, each in its own sandbox.
    Returns a SandboxResult; stdout/stderr are cut at `limits.output_bytes`. No process the
    program started is alive when this returns. With namespaces the program is PID 1 of its
    PID namespace: like any init process, it ignores signals it sends itself without a handler.
    """
    if not isinstance(program, str):
        raise TypeError(f"program must be a str of Python source, got {type(program).__name__}")
    for name in files or {}:
        if not isinstance(name, str) or not name or os.path.basename(name) != name or name in (".", ".."):
            raise ValueError(f"files keys must be plain file names, got {name!r}")
    return _run(
        {"program": program, "files": dict(files or {}), "stdin": stdin, "args": list(args), "setup": None},
        None,
        limits or SandboxLimits(),
        require_isolation,
    )


def run_judged(
    program: str, tests: dict, *, limits: SandboxLimits | None = None, require_isolation: bool = False
) -> SandboxResult:
    """Run `program` in the sandbox and its tests outside it; `passed` counts the tests passed.

    tests: the judge's spec, as `rewards.code.normalize_tests` makes it (see `_judge.judge`):
        {"kind": "asserts" | "check", "asserts" | "test": ..., "setup": str,
        "entry_point": str | None, "names": [str]}. `setup` runs before the program, in the
        sandbox and in the judge.
    """
    return _run(
        {"program": program, "files": {}, "stdin": "", "args": [], "setup": tests["setup"]},
        tests,
        limits or SandboxLimits(),
        require_isolation,
    )


@contextmanager
def _uid_slot():
    with _slot_lock:
        slot = min(set(range(len(_busy_slots) + 1)) - _busy_slots)
        _busy_slots.add(slot)
    try:
        yield slot
    finally:
        with _slot_lock:
            _busy_slots.discard(slot)


@functools.cache
def _python_dirs() -> tuple[list[str], list[str]]:
    """The Python installation (shown read-only in the sandbox) and its site-packages (put on sys.path)."""
    site_packages = [p for p in site.getsitepackages() if os.path.isdir(p)]
    dirs = {
        os.path.realpath(p)
        for p in (
            sys.base_prefix,
            sys.prefix,
            sys.exec_prefix,
            os.path.dirname(os.path.realpath(sys.executable)),
            *site_packages,
        )
    }
    return sorted(dirs, key=len), site_packages


@functools.cache
def _cgroup_parent() -> str | None:
    """The cgroup v2 directory under which each sandbox gets a cgroup of its own, or None.

    GRPO_FAST_SANDBOX_CGROUP names one (delegated to this user, with the memory and pids
    controllers in its cgroup.subtree_control, holding no process); otherwise this process's
    own cgroup is used when it qualifies (it rarely does: a cgroup with processes cannot
    hand controllers down).
    """
    configured = os.environ.get("GRPO_FAST_SANDBOX_CGROUP")
    if configured:
        if not _usable_cgroup(configured):
            raise ValueError(
                f"GRPO_FAST_SANDBOX_CGROUP must be a writable cgroup v2 directory with memory and pids "
                f"in its cgroup.subtree_control, got {configured!r}"
            )
        return configured
    try:
        with open("/proc/self/cgroup") as f:
            own = next(line[3:].strip() for line in f if line.startswith("0::"))
        with open("/proc/self/mountinfo") as f:
            mount = next(fields[4] for fields in map(str.split, f) if fields[fields.index("-") + 1] == "cgroup2")
    except (OSError, StopIteration):
        return None
    path = os.path.join(mount, own.lstrip("/"))
    return path if _usable_cgroup(path) else None


def _usable_cgroup(path: str) -> bool:
    try:
        with open(os.path.join(path, "cgroup.subtree_control")) as f:
            controllers = f.read().split()
    except OSError:
        return False
    return {"memory", "pids"} <= set(controllers) and os.access(path, os.W_OK)


def _message(obj) -> bytes:
    data = json.dumps(obj).encode()
    return b"%012d" % len(data) + data


def _run(job: dict, tests: dict | None, limits: SandboxLimits, require_isolation: bool) -> SandboxResult:
    """One sandboxed run; where the namespaces turn out unusable here, the fallback from then on (one warning)."""
    global _namespaces_refused
    if os.environ.get("GRPO_FAST_SANDBOX_NO_NAMESPACES") == "1":
        refused = "namespaces turned off by GRPO_FAST_SANDBOX_NO_NAMESPACES"
    else:
        refused = _namespaces_refused
    result, namespace_error = _run_once(job, tests, limits, require_isolation, refused)
    if namespace_error is None:
        return result
    if require_isolation:
        return replace(result, error=f"isolation is required but the namespaces cannot be used here: {namespace_error}")
    # Made but unusable (id maps or mounts refused: AppArmor's restriction of unprivileged user
    # namespaces, say). Nothing of the program ran: run it in the fallback, and so every later one.
    _namespaces_refused = f"the namespaces cannot be used here: {namespace_error}"
    return _run_once(job, tests, limits, require_isolation, _namespaces_refused)[0]


def _run_once(
    job: dict, tests: dict | None, limits: SandboxLimits, require_isolation: bool, namespaces_refused: str | None
) -> tuple[SandboxResult, str | None]:
    """One bootstrap; returns its result and, where its namespaces were made but proved unusable, why."""
    root = os.geteuid() == 0
    python_dirs, site_packages = _python_dirs()
    cgroup = _cgroup_parent()
    with _uid_slot() as slot:
        uid = UID_BASE + slot if root else None
        if uid is not None and not 0 < uid < 2**32 - 1:  # (uid_t)-1 would mean "keep root"
            raise ValueError(f"GRPO_FAST_SANDBOX_UID_BASE + slot must be a uid in [1, 2**32 - 2], got {uid}")
        out_fd, err_fd = os.memfd_create("sandbox_stdout"), os.memfd_create("sandbox_stderr")
        try:
            cfg = {
                **job,
                "limits": {**asdict(limits), "cpu_time_s": int(limits.cpu_time_s or math.ceil(limits.wall_time_s))},
                "process_memory_bytes": limits.memory_bytes if cgroup else limits.memory_bytes // limits.max_processes,
                "uid": uid,
                "namespaces_refused": namespaces_refused,
                "require_isolation": require_isolation,
                "python_dirs": python_dirs,
                "site_packages": site_packages,
                "tmpdir": tempfile.gettempdir(),
                "cgroup_parent": cgroup,
                "stdout_fd": out_fd,
                "stderr_fd": err_fd,
            }
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _BOOT_COMMAND],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(out_fd, err_fd),
                start_new_session=True,
                env={},
                cwd="/",
            )
            messages = _message(cfg) + (_message(tests) if tests is not None else b"")
            try:
                status_lines, boot_err = proc.communicate(messages, timeout=limits.wall_time_s + _BOOT_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the sandbox dies with it (PDEATHSIG, PID namespace)
                status_lines, boot_err = proc.communicate()
            except BrokenPipeError:  # it died before reading the tests: what it says on stderr tells why
                status_lines, boot_err = proc.stdout.read(), proc.stderr.read()
                proc.wait()
            return _result(status_lines, boot_err, proc.returncode, out_fd, err_fd, limits.output_bytes)
        finally:
            os.close(out_fd)
            os.close(err_fd)


def _result(
    status_lines: bytes, boot_err: bytes, returncode: int, out_fd: int, err_fd: int, output_bytes: int
) -> tuple[SandboxResult, str | None]:
    statuses = []
    for line in status_lines.decode(errors="replace").splitlines():
        try:
            statuses.append(json.loads(line))
        except ValueError:
            pass
    forked = next((s for s in statuses if s.get("forked")), None)
    started = next((s for s in statuses if s.get("started")), None)
    final = next((s for s in statuses if "exit_code" in s or "setup_error" in s), {})
    error = final.get("setup_error")
    if final.get("namespaces"):
        return _empty_result(forked or final, error), error
    if forked is None and error is None:
        # The bootstrap ended before the program could run, without a word on its status
        # line: its stderr and how it ended are all there is to say where.
        how = f"was killed by signal {-returncode}" if returncode < 0 else f"exited with status {returncode}"
        stderr = boot_err.decode(errors="replace").strip()[-2000:]
        error = f"the sandbox bootstrap {how} before starting the program" + (
            f"; its stderr: {stderr}" if stderr else " and wrote nothing to stderr"
        )
    if final.get("judge_error"):
        error = f"the tests failed outside the sandbox (the tests' fault, not the program's): {final['judge_error']}"
    isolation = (started or forked or final).get("isolation", "none")
    if started is not None and isolation in ("landlock", "none") and not _warned_fallback.is_set():
        _warned_fallback.set()
        warnings.warn(
            f"the code sandbox runs without namespaces ({started['reason']}): a weaker fallback, see "
            "SECURITY.md; pass require_isolation=True to refuse instead",
            RuntimeWarning,
            stacklevel=5,
        )
    result = SandboxResult(
        stdout=os.pread(out_fd, output_bytes, 0).decode(errors="replace"),
        stderr=os.pread(err_fd, output_bytes, 0).decode(errors="replace"),
        exit_code=final.get("exit_code"),
        signal=final.get("signal"),
        # A run whose bootstrap died after the fork without a final word (killed by the
        # backstop, or by anything else once the program may have run) counts as timed out.
        timed_out=final.get("timed_out", forked is not None),
        isolation=isolation,
        wall_s=final.get("wall_s", 0.0),
        error=error,
        passed=final.get("passed"),
    )
    return result, None


def _empty_result(status: dict, error: str) -> SandboxResult:
    return SandboxResult(
        stdout="",
        stderr="",
        exit_code=None,
        signal=None,
        timed_out=False,
        isolation=status.get("isolation", "none"),
        wall_s=0.0,
        error=error,
    )
