"""Run an untrusted Python program in a separate, limited, isolated process.

`run_python(program, files=..., stdin=...)` starts `_sandbox_boot.py` in a new session;
that bootstrap puts the program in fresh PID/network/mount namespaces (when running as
root), applies the resource limits, drops to a dedicated unprivileged uid and enforces the
wall-clock limit. See SECURITY.md for the threat model and what the fallback without root
does not cover. Only the standard library is used.
"""

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass

_BOOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_boot.py")
# Sandboxed programs run as uid UID_BASE + slot, the slot unique among this process's
# concurrent runs: a uid that owns no file and no other process, so RLIMIT_NPROC counts
# only that sandbox's processes and it can signal no one. Separate Python processes on one
# machine share slots (and so the process budget); give each its own base if that matters.
UID_BASE = int(os.environ.get("GRPO_FAST_SANDBOX_UID_BASE", "64000"))
_slot_lock = threading.Lock()
_busy_slots: set[int] = set()
# Time the bootstrap itself may take (interpreter start, namespaces) beyond the wall limit
# before the caller kills its whole session as a backstop.
_BOOT_GRACE_S = 10.0


@dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits. Every field must be positive.

    wall_time_s:   wall-clock seconds from exec to SIGKILL of the whole process tree.
    cpu_time_s:    CPU seconds per process (RLIMIT_CPU); None = ceil(wall_time_s).
    memory_bytes:  address space per process (RLIMIT_AS).
    max_processes: processes and threads of the sandbox uid (RLIMIT_NPROC).
    output_bytes:  largest stdout, stderr or file it may write (RLIMIT_FSIZE: writes beyond fail).
    open_files:    file descriptors per process (RLIMIT_NOFILE).
    scratch_bytes: total size of the scratch dir, a tmpfs (full isolation only).
    """

    wall_time_s: float = 4.0
    cpu_time_s: int | None = None
    memory_bytes: int = 512 << 20
    max_processes: int = 32
    output_bytes: int = 1 << 20
    open_files: int = 64
    scratch_bytes: int = 64 << 20

    def __post_init__(self):
        for name, value in asdict(self).items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"SandboxLimits.{name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class SandboxResult:
    """What one run produced. `ok` is True when it exited with status 0 before the deadline."""

    stdout: str
    stderr: str
    exit_code: int | None  # None when killed by a signal
    signal: int | None  # e.g. 9 (SIGKILL) at the deadline
    timed_out: bool
    isolated: bool  # namespaces were available (see SECURITY.md for the fallback)
    wall_s: float
    error: str | None = None  # the sandbox itself failed to start the program

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and self.error is None


def run_python(program: str, *, files: dict[str, str] | None = None, stdin: str = "",
               args: tuple[str, ...] = (), limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `python -I -S -c program *args` in the sandbox and wait for it.

    Installed packages are importable (site-packages is on sys.path), but `.pth` hooks do
    not run, so editable installs are not.

    program: Python source, run with a fresh scratch directory as cwd (/tmp in full isolation).
    files:   {relative name: text} written into the scratch directory first.
    stdin:   text fed to the program's stdin.
    Thread-safe: concurrent calls run in parallel, each under its own uid.
    Returns a SandboxResult; stdout/stderr are cut at `limits.output_bytes`. No process the
    program started is alive when this returns.
    """
    if not isinstance(program, str):
        raise TypeError(f"program must be a str of Python source, got {type(program).__name__}")
    limits = limits or SandboxLimits()
    # GRPO_FAST_SANDBOX_UNPRIVILEGED=1 runs as a non-root caller would (no namespaces, no
    # uid change) so that tests can exercise that fallback as root.
    privileged = os.geteuid() == 0 and os.environ.get("GRPO_FAST_SANDBOX_UNPRIVILEGED") != "1"
    with _uid_slot() as slot:
        uid = UID_BASE + slot
        if privileged and not 0 < uid < 2**32 - 1:  # (uid_t)-1 would mean "keep root"
            raise ValueError(f"GRPO_FAST_SANDBOX_UID_BASE + slot must be a uid in [1, 2**32 - 2], got {uid}")
        return _run(program, files or {}, stdin, args, limits, uid if privileged else None)


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


def _run(program: str, files: dict, stdin: str, args, limits: SandboxLimits, uid: int | None) -> SandboxResult:
    with tempfile.TemporaryDirectory(prefix="grpo_fast_sandbox_", ignore_cleanup_errors=True) as workdir:
        os.chmod(workdir, 0o711)  # the sandbox uid may pass through to scratch/, not list it
        scratch = os.path.join(workdir, "scratch")
        os.mkdir(scratch, 0o700)
        for name, text in files.items():
            path = os.path.join(scratch, name)
            if os.path.dirname(os.path.normpath(name)) or os.path.isabs(name):
                raise ValueError(f"files keys must be plain file names, got {name!r}")
            with open(path, "w") as f:
                f.write(text)
            if uid is not None:
                os.chown(path, uid, uid)
        if uid is not None:
            os.chown(scratch, uid, uid)
        stdin_path = os.path.join(workdir, "stdin")
        with open(stdin_path, "w") as f:
            f.write(stdin)
        out_path, err_path = os.path.join(workdir, "stdout"), os.path.join(workdir, "stderr")
        out_fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        err_fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        cfg = {
            "program": program,
            "args": list(args),
            "python": os.path.realpath(sys.executable),
            "prefix": os.path.realpath(sys.base_prefix),
            "workdir": workdir,
            "scratch": scratch,
            "uid": uid,
            "namespaces": uid is not None,
            "stdout_fd": out_fd,
            "stderr_fd": err_fd,
            "limits": {**asdict(limits), "cpu_time_s": int(limits.cpu_time_s or math.ceil(limits.wall_time_s))},
        }
        start = time.monotonic()
        try:
            with open(stdin_path, "rb") as stdin_file:
                proc = subprocess.Popen(
                    [sys.executable, "-I", "-S", _BOOT, json.dumps(cfg)],
                    stdin=stdin_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    pass_fds=(out_fd, err_fd), start_new_session=True, env={}, cwd=workdir,
                )
        finally:
            os.close(out_fd)
            os.close(err_fd)
        try:
            status_line, boot_err = proc.communicate(timeout=limits.wall_time_s + _BOOT_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the program dies with it (PDEATHSIG)
            status_line, boot_err = proc.communicate()
        wall = time.monotonic() - start
        try:
            status = json.loads(status_line.decode().strip().splitlines()[-1])
        except (ValueError, IndexError):
            status = {"isolated": False, "timed_out": True, "exit_code": None, "signal": None,
                      "setup_error": "sandbox bootstrap failed: " + boot_err.decode(errors="replace")[-2000:]}
        return SandboxResult(
            stdout=_read_capped(out_path, limits.output_bytes),
            stderr=_read_capped(err_path, limits.output_bytes),
            exit_code=status["exit_code"],
            signal=status["signal"],
            timed_out=status["timed_out"],
            isolated=status["isolated"],
            wall_s=status.get("wall_s", wall),
            error=status["setup_error"],
        )


def _read_capped(path: str, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode(errors="replace")
