"""Sandbox bootstrap: started by `runner.py` as `python -I -S -c "...; _boot.main()"`.

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
  3. meanwhile judges (for code_reward's tests: `_judge.judge`) or waits, kills the
     child at the deadline, and reports. When PID 1 of a namespace dies the kernel kills
     every other process in it: nothing the program started survives. In the fallback this
     process is the child subreaper and kills every descendant itself.
The mechanisms of each step are in `_confine.py`; this module is their order, the protocol and
the process outside the sandbox. Only the standard library is used: this module runs before
anything else is importable.
"""

import atexit
import json
import os
import signal
import sys
import time

import _judge
from _confine import (
    PR_SET_CHILD_SUBREAPER,
    PR_SET_DUMPABLE,
    SECCOMP_DENIED,
    SYS_LANDLOCK_RESTRICT_SELF,
    SYSCALLS,
    SetupError,
    build_root,
    check,
    describe,
    drop_privileges,
    enter_namespaces,
    install_seccomp,
    landlock_abi,
    landlock_ruleset,
    libc,
    set_limits,
    stage,
    switch_uid,
)

SETUP_FAILED = 121
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


# ---------------------------------------------------------------- the child (inside the sandbox)


def _child(cfg: dict, isolation: str, scratch: str | None, setup_pipe: int, channel) -> None:
    """The forked child: set up the sandbox, then run the program. Never returns."""
    try:
        _set_up_child(cfg, isolation, scratch)
    except BaseException as exc:  # noqa: BLE001 - any failure must reach the parent
        if not isinstance(exc, SetupError):
            exc = SetupError(f"sandbox set-up: {describe(exc)}")
        os.write(setup_pipe, json.dumps({"error": str(exc)[:4000], "namespaces": exc.namespaces}).encode())
        os._exit(SETUP_FAILED)
    os.close(setup_pipe)  # set up: from here on, whatever happens is the program's doing
    main_module = type(sys)("__main__")
    sys.modules["__main__"] = main_module  # pickle (multiprocessing) finds the program's functions
    sys.argv = ["-c", *cfg["args"]]
    try:
        if channel is not None:
            _judge.serve(cfg["setup"], cfg["program"], *channel)
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
    with stage("new session"):
        # A session and process group of its own: kill(0, ...) and killpg(getpgrp(), ...)
        # then reach only the sandbox, never this bootstrap (which, in a user namespace, runs
        # under the same uid and so may be signalled by it otherwise).
        os.setsid()
    if cfg["cgroup"] is not None:
        with stage("cgroup"), open(os.path.join(cfg["cgroup"], "cgroup.procs"), "w") as f:
            f.write("0")  # this process, before it can start any other
    with stage("standard streams"):
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
        with stage("private root (mount namespace)", namespaces=True):
            build_root(cfg, uid, gid)
    if isolation == "landlock":  # opened with the caller's rights: the sandbox uid may not reach them all
        with stage("landlock rules"):
            ruleset = landlock_ruleset(cfg, scratch, landlock_abi())
    with stage("switch to the sandbox uid"):
        switch_uid(cfg)
    if isolation == "user":
        with stage("private root (mount namespace)", namespaces=True):
            build_root(cfg, uid, gid)
    with stage("drop privileges"):
        if scratch is not None:
            os.chdir(scratch)
        drop_privileges()
    with stage("write the program's files"):
        for name, text in cfg["files"].items():
            with open(name, "w") as f:
                f.write(text)
    with stage("resource limits"):
        set_limits(cfg["limits"], cfg["process_memory_bytes"])
    if isolation == "landlock":
        with stage("landlock"):
            check(libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0), "landlock_restrict_self")
            os.close(ruleset)
    if isolation in ("landlock", "none"):
        with stage("seccomp filter"):
            install_seccomp(*SECCOMP_DENIED[os.uname().machine])
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
    isolation, reason = enter_namespaces(cfg)
    with stage("prctl(PR_SET_DUMPABLE)"):
        # Not dumpable (set after the uid maps, which a non-dumpable process cannot write): in
        # the fallback the program may run under this uid, and must not read this process's
        # memory or open its file descriptors (the tests wait in the configuration pipe) via /proc.
        check(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")
    if isolation == "none" and cfg["require_isolation"]:
        raise SetupError(f"isolation is required but no namespace is available ({reason})")
    scratch = None
    if isolation == "none":
        if os.uname().machine not in SECCOMP_DENIED:
            raise SetupError(
                f"the fallback ({reason}) needs a seccomp filter, which has no table for {os.uname().machine}"
            )
        with stage("fallback scratch dir"):
            check(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(CHILD_SUBREAPER)")
            scratch = os.path.join(cfg["tmpdir"], f"grpo_fast_sandbox_{os.getpid()}")
            os.mkdir(scratch, 0o700)
            if cfg["uid"] is not None:
                os.chown(scratch, cfg["uid"], cfg["uid"])
        if landlock_abi():
            isolation = "landlock"
    with stage("cgroup"):
        cfg["cgroup"] = _make_cgroup(cfg)
    return isolation, reason, scratch


def main() -> None:
    """Sets the sandbox up, runs the program, judges it and reports (see the module docstring).

    Every failure before the program runs is reported as {"setup_error": "<stage>: <error with
    its errno>", "namespaces": bool}; {"forked": ...} says the program may have run, so that a
    bootstrap that dies after it (whatever killed it) scores the run, never fails the call.
    """
    try:
        with stage("configuration"):
            cfg = _read_message(0)
        sys.path += cfg["site_packages"]  # importable for the program and for the tests, without .pth hooks
        isolation, reason, scratch = _prepare(cfg)
        judged = cfg["setup"] is not None
        with stage("fork"):
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
            channel = _judge.Channel(requests_write, replies_read, deadline, cfg["limits"]["output_bytes"])
            try:
                passed = _judge.judge(tests, channel)
            except Exception as exc:  # noqa: BLE001 - the trusted tests themselves are broken: say so
                judge_error = describe(exc)
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
