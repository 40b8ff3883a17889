"""Sandbox bootstrap: a standalone script, run by `sandbox.run_python` in a new session.

Usage: python -I -S _sandbox_boot.py CONFIG_JSON   (stdin: the program's stdin;
stdout: one JSON status line; the program's stdout/stderr go to the fds named in CONFIG).

It runs with the caller's privileges (root for full isolation) and
  1. unshares new PID, network and mount namespaces (root only; otherwise it falls back to
     rlimits, a Python-level socket block and killing every descendant it can find as their
     child subreaper, see SECURITY.md);
  2. forks the child, which becomes PID 1 of the new PID namespace. The child mounts a
     fresh /proc, makes the interpreter reachable for the sandbox uid, mounts a
     size-capped tmpfs scratch dir (with the input files) on /tmp and binds it over every
     other world-writable dir, sets the resource limits,
     drops to the sandbox uid with no_new_privs, and execs `python -I -S -c PROGRAM`;
  3. waits for the child under the wall-clock limit and SIGKILLs it at the deadline. When
     PID 1 of a namespace dies the kernel kills every other process in it, and waitpid on
     PID 1 returns only after they are all gone: nothing the program started survives.
Only the standard library is used: this file must run before anything is importable.
"""

import ctypes
import json
import os
import resource
import signal
import stat
import sys
import time

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38
# Every directory a non-root user can write on a stock Linux image.
WORLD_WRITABLE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/var/lock", "/dev/mqueue")
SETUP_FAILED = 121

# Prepended to the program when no network namespace could be made (not root). A Python
# level block only: code that reaches the socket syscall another way (ctypes) gets through.
NETWORK_BLOCK_PRELUDE = """\
import _socket, socket
def _grpo_fast_no_network(*args, **kwargs):
    raise PermissionError("network access is disabled in the grpo_fast sandbox")
for _name in ("socket", "socketpair", "fromfd", "getaddrinfo", "gethostbyname"):
    setattr(_socket, _name, _grpo_fast_no_network)
    setattr(socket, _name, _grpo_fast_no_network)
socket.create_connection = _grpo_fast_no_network
del _socket, socket, _name, _grpo_fast_no_network
"""

# Installed packages stay importable, but the interpreter starts with -S: the .pth hooks
# that `site` would run cost more than the rest of a sandboxed run together.
SITE_PACKAGES_PRELUDE = "import site, sys; sys.path += [p for p in site.getsitepackages() if p not in sys.path]\n"

libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target: str, fstype, flags: int, data=None) -> None:
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    _check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def _expose_interpreter(prefix: str, holding_root: str) -> None:
    """Make `prefix` (the Python installation) traversable by an unprivileged uid.

    Python may live under a private directory (pyenv under /root, mode 0700). For each such
    ancestor, the one child on the path is bind-mounted aside, an empty tmpfs hides the
    ancestor (and whatever secrets it holds), and the child is bound back into it.
    """
    parts = prefix.strip("/").split("/")
    for depth in range(1, len(parts)):
        ancestor = "/" + "/".join(parts[:depth])
        if os.stat(ancestor).st_mode & stat.S_IXOTH:
            continue
        child = os.path.join(ancestor, parts[depth])
        holding = os.path.join(holding_root, f"hold{depth}")
        os.mkdir(holding, 0o700)
        _mount(child, holding, None, MS_BIND | MS_REC)
        _mount("tmpfs", ancestor, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=64k")
        os.mkdir(child, 0o755)
        _mount(holding, child, None, MS_BIND | MS_REC)


def _isolate_filesystem(cfg: dict) -> None:
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the host
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # shows only this namespace
    _expose_interpreter(cfg["prefix"], cfg["workdir"])
    # The scratch dir becomes a size-capped tmpfs at /tmp holding copies of the input files:
    # the program's writes are bounded in total and never reach the host's disk.
    files = {}
    for name in os.listdir(cfg["scratch"]):
        with open(os.path.join(cfg["scratch"], name), "rb") as f:
            files[name] = f.read()
    uid = cfg["uid"]
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={cfg['limits']['scratch_bytes']},mode=0700,uid={uid},gid={uid}")
    for name, data in files.items():
        path = os.path.join("/tmp", name)
        with open(path, "wb") as f:
            f.write(data)
        os.chown(path, uid, uid)
    for path in WORLD_WRITABLE_DIRS:
        if path != "/tmp" and os.path.isdir(path) and not os.path.islink(path):
            _mount("/tmp", path, None, MS_BIND)
    os.chdir("/tmp")


def _set_limits(cfg: dict) -> None:
    lim = cfg["limits"]
    cpu = lim["cpu_time_s"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (lim["memory_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_NPROC, (lim["max_processes"],) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (lim["output_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lim["open_files"],) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _child(cfg: dict, isolated: bool) -> None:
    """Runs in the forked child; never returns (exec or raise)."""
    os.dup2(cfg["stdout_fd"], 1)
    os.dup2(cfg["stderr_fd"], 2)
    if isolated:
        _isolate_filesystem(cfg)
    else:
        os.setpgid(0, 0)  # its own group, so the deadline kill does not hit this bootstrap
        os.chdir(cfg["scratch"])
    _set_limits(cfg)
    if cfg["uid"] is not None:
        os.setgroups([])
        os.setresgid(cfg["uid"], cfg["uid"], cfg["uid"])
        os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
        if os.getresuid() != (cfg["uid"],) * 3 or os.getresgid() != (cfg["uid"],) * 3:
            raise OSError(f"could not drop privileges to uid {cfg['uid']}")
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")  # no setuid binaries
    # Set after the uid change, which clears it: the child dies with this bootstrap.
    _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
    program = SITE_PACKAGES_PRELUDE + ("" if isolated else NETWORK_BLOCK_PRELUDE) + cfg["program"]
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": os.getcwd(), "LANG": "C.UTF-8"}
    os.execve(cfg["python"], [cfg["python"], "-I", "-S", "-c", program, *cfg["args"]], env)


def _reap_descendants() -> None:
    """Without a PID namespace: kill and reap every remaining descendant.

    This process is a child subreaper, so the program's orphans, also those that left its
    process group with setsid(), are re-parented here, where they can be found and killed.
    """
    while True:
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children") as f:
                for pid in f.read().split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.001)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    isolation_error = "not root"
    isolated = cfg["namespaces"]
    if isolated:
        try:
            _check(libc.unshare(CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWNS), "unshare")
            isolation_error = None
        except OSError as exc:
            isolated, isolation_error = False, str(exc)
    if not isolated:
        _check(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(CHILD_SUBREAPER)")
    # The child reports a setup failure through this pipe; a successful exec closes it (CLOEXEC).
    err_read, err_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(err_read)
            _child(cfg, isolated)
        except BaseException as exc:  # noqa: BLE001 - any failure must reach the parent
            os.write(err_write, f"{type(exc).__name__}: {exc}".encode()[:4000])
        os._exit(SETUP_FAILED)
    os.close(err_write)
    with os.fdopen(err_read, "rb") as pipe:
        setup_error = pipe.read().decode(errors="replace") or None
    start = time.monotonic()
    timed_out = False

    def _deadline(signum, frame):
        nonlocal timed_out
        timed_out = True
        if isolated:
            os.kill(pid, signal.SIGKILL)  # PID 1: the kernel kills the rest of its namespace
        else:
            os.killpg(pid, signal.SIGKILL)

    if setup_error is None:
        signal.signal(signal.SIGALRM, _deadline)
        signal.setitimer(signal.ITIMER_REAL, cfg["limits"]["wall_time_s"])
    _, status = os.waitpid(pid, 0)
    signal.setitimer(signal.ITIMER_REAL, 0)
    if not isolated:
        _reap_descendants()
    print(json.dumps({
        "isolated": isolated,
        "isolation_error": isolation_error,
        "setup_error": setup_error,
        "timed_out": timed_out,
        "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        "wall_s": time.monotonic() - start,
    }), flush=True)


if __name__ == "__main__":
    main()
