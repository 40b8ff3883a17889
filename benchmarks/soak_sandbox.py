"""Soak of the code sandbox: N programs through code_reward and the python tool in one long process.

One worker process (the trainer's stand-in, alive for the whole run) scores blocks of 100
programs as the trainer does: the block's reward programs in one `code_reward` call (one
sandbox per core, its default pool) and its tool programs in one `run_tool_calls` call (every
call at once, the python tool held to one sandbox per core, the trainer's 10 s timeout). Each
block holds the same mix, in the same shuffled order:

    reward route (50)  18 honest (the sample tasks' and HumanEval's canonical solutions, one
                       of them test_sandbox's own honest program), 8 wrong (HumanEval bodies
                       that return None), 24 hostile: tests/test_sandbox.py's HOSTILE battery
                       and DISRUPTIVE programs (these with a wrong add), and EXTRA_HOSTILE below
    tool route (50)    the same 18 + 8 with their tests run inside the tool's sandbox and a final
                       print('PASS'), and the same 24 hostile programs run as tool calls

The hostile programs, their limits (under which each one's tests pass exactly when its attack
works) and the environment they attack (a directory of the caller's files, listening sockets,
a secret, signal counters) are test_sandbox's `Battery`: its caller runs the whole soak, and it
reports afterwards what reached the host. The caller is root, or an ordinary account (made
with useradd if missing, uid >= 1000), as test_sandbox runs them.

Reported: programs per second per 500 programs; verdicts per route, family and kind; every
100 programs, the worker's open fds, threads, descendant processes, RSS, mounts, entries of its
temp dir (a private TMPDIR) and the cgroup folders the sandbox made. Guarantees, each pass or
fail (any fail: exit status 1): no forged pass (a hostile or wrong program scored as passing),
no honest program failed, nothing reached the host, the last 1,000 programs' throughput at
least 80% of the first 1,000's (for a smaller N, the first and last fifth in whole blocks: a
leak slows the end down; a faster end is the first block's cold caches or a quieter host, and
passes), no growth
of fds, threads, children, mounts, temp entries or cgroups from the sample after the first
block to the end, and RSS growth under 50 MB.

    python benchmarks/soak_sandbox.py                     # 5,000 as root and as the account
    python benchmarks/soak_sandbox.py -n 300 --as user --out /tmp/soak.json
"""

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = 100
# The block's mix per route (the hostile count is that of the hostile programs).
HONEST, WRONG = 18, 8
TOOL_TIMEOUT_S = 10.0  # the trainer's tool_timeout_s default
RSS_GROWTH_LIMIT = 50 << 20
THROUGHPUT_TOLERANCE = 0.2
# Attacks the battery has no program for. Each passes its test exactly when the attack
# works; $trainer_pid is the worker's pid.
EXTRA_HOSTILE = {
    "infinite_loop": ("def add(a, b):\n    return a + b\nwhile True:\n    pass\n", "assert add(1, 2) == 3"),
    # 20 MB of stdout, far past the output limit, before a correct function.
    "output_flood": (
        "for _ in range(200):\n    print('x' * 100_000)\ndef add(a, b):\n    return a + b\n",
        "assert add(1, 2) == 3",
    ),
    # Files of one block each until the scratch cap stops them: 20,000 would be 80 MB.
    "file_flood": (
        "made = 0\ntry:\n    while made < 20_000:\n        with open(f'f{made}', 'w') as f:\n"
        "            f.write('x')\n        made += 1\nexcept OSError:\n    pass\n",
        "assert made >= 20_000",
    ),
    "proc_parent": (
        "import os\nreached = 0\nfor name in ('environ', 'cmdline', 'status', 'fd', 'mem'):\n"
        "    try:\n        path = f'/proc/$trainer_pid/{name}'\n"
        "        os.listdir(path) if name == 'fd' else open(path, 'rb').read(64)\n        reached += 1\n"
        "    except OSError:\n        pass\n",
        "assert reached > 0",
    ),
    # PTRACE_SEIZE stops nothing, so a broken sandbox would not freeze the worker either.
    "ptrace_parent": (
        "import ctypes\nlibc = ctypes.CDLL(None)\nattached = libc.ptrace(0x4206, $trainer_pid, 0, 0) == 0\n"
        "if attached:\n    libc.ptrace(17, $trainer_pid, 0, 0)\n",
        "assert attached",
    ),
}


# ---------------------------------------------------------------- the workload (the caller's side)


def tool_program(code: str, tests) -> str:
    """`code` with its tests run after it, inside the tool's own sandbox, then PASS."""
    checks = f"{tests['test']}\ncheck({tests['entry_point']})" if isinstance(tests, dict) else "\n".join(tests)
    return f"{code}\n{checks}\nprint('PASS')\n"


def block_template(request: dict) -> dict:
    """The pools every block draws from, each entry (kind, program, tests), by family."""
    from bench_code_reward import SOLUTIONS, make_batch
    from test_sandbox import DISRUPTIVE, humaneval_problems

    from grpo_fast.rewards import extract_code

    _, completions, tests = make_batch(len(SOLUTIONS))
    honest = [("sample_task", extract_code(c), t) for c, t in zip(completions, tests)]
    wrong = []
    for p in humaneval_problems():
        spec = {"test": p["test"], "entry_point": p["entry_point"], "setup": p["prompt"]}
        honest.append(("humaneval", p["prompt"] + p["canonical_solution"], spec))
        wrong.append(("humaneval_returns_none", p["prompt"] + "    return None\n", spec))
    battery = dict(zip(request["names"], zip(request["programs"], request["tests"])))
    hostile = [(name, *battery[name]) for name in request["names"] if name != "honest"]
    hostile += [
        (name, code + "def add(a, b):\n    return a - b\n", ["assert add(1, 2) == 3"])
        for name, (code, _) in DISRUPTIVE.items()
    ]
    hostile += [(name, code, [test]) for name, (code, test) in EXTRA_HOSTILE.items()]
    # The battery's honest program reads the caller's files from the judge: a reward program only.
    return {"honest": honest, "wrong": wrong, "hostile": hostile, "battery_honest": ("battery", *battery["honest"])}


def workload(request: dict, n: int) -> list[dict]:
    """n cases in blocks of BLOCK, each block the same mix in the same order (see the docstring)."""
    pools = block_template(request)
    slots = [("hostile", i) for i in range(len(pools["hostile"]))] + [("wrong", i) for i in range(WRONG)]
    slots += [("honest", i) for i in range(HONEST)]
    if 2 * len(slots) != BLOCK:
        raise ValueError(f"a block must hold {BLOCK} programs, the mix makes {2 * len(slots)}")
    order = list(range(len(slots)))
    random.Random(0).shuffle(order)
    cases = []
    for block in range(n // BLOCK):
        for route in ("reward", "tool"):
            for family, i in (slots[j] for j in order):
                if family == "hostile":
                    kind, code, tests = pools["hostile"][i]
                elif family == "honest" and i == 0 and route == "reward":
                    kind, code, tests = pools["battery_honest"]
                else:
                    pool = pools[family]
                    kind, code, tests = pool[(block * (HONEST if family == "honest" else WRONG) + i) % len(pool)]
                program = code if route == "reward" or family == "hostile" else tool_program(code, tests)
                cases.append({"route": route, "family": family, "kind": kind, "program": program, "tests": tests})
    return cases


# ---------------------------------------------------------------- the worker (the long-lived process)


def descendants(pid: int) -> list[int]:
    """Every live process below `pid`, from /proc's parent links."""
    parents = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parents[int(entry)] = int(f.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError):
            continue
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def resources(programs: int, start: float, cgroup_parent: str | None) -> dict:
    """One sample of what the worker holds (see the module docstring)."""
    # A tool call's thread hands its answer over just before it ends, and leaves Python's
    # thread table before the kernel's: wait for the kernel's count, which the sample reads
    # (a thread that a call really left behind is still there a second later).
    settle = time.monotonic() + 1.0
    while len(os.listdir("/proc/self/task")) > 1 and time.monotonic() < settle:
        time.sleep(0.01)
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/mountinfo") as f:
        mounts = sum(1 for _ in f)
    cgroups = None
    if cgroup_parent is not None:
        cgroups = sum(name.startswith("grpo_fast_sandbox_") for name in os.listdir(cgroup_parent))
    return {
        "programs": programs,
        "elapsed_s": round(time.monotonic() - start, 2),
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": len(os.listdir("/proc/self/task")),
        "children": len(descendants(os.getpid())),
        "rss_bytes": rss,
        "mounts": mounts,
        "temp_entries": len(os.listdir(tempfile.gettempdir())),
        "cgroups": cgroups,
    }


def reward_verdict(score) -> str:
    if score is None:
        return "none"
    return "pass" if score == 1.0 else "fail" if score == 0.0 else "partial"


def tool_verdict(result) -> str:
    """What the model would read, as a verdict: PASS alone is a pass; else the tool's own note."""
    if result.failed:
        return "call_failed"  # run_tool_calls' timeout, or the tool raised
    text = result.content
    if text.strip() == "PASS":
        return "pass"
    for verdict, note in (
        ("timeout", "error: timed out"),
        ("killed", "error: the program was killed"),
        ("sandbox_error", "error: the sandbox could not"),
    ):
        if note in text:
            return verdict
    return "fail"


def worker() -> None:
    """`--worker`: runs the cases of the JSON request on stdin in blocks; prints the JSON report."""
    sys.path.insert(0, REPO)
    from grpo_fast.rewards import SandboxLimits, code_reward
    from grpo_fast.sandbox import run_python, runner
    from grpo_fast.tools import Tool, ToolCall, run_tool_calls
    from grpo_fast.tools.python import python

    request = json.load(sys.stdin)
    received = []
    signal.signal(signal.SIGUSR1, lambda signum, frame: received.append(signum))
    # resolve_tools would build the same Tool, but its schema needs transformers, which the
    # account's interpreter need not have; the schema only shows the tool to a model.
    tools = {"python": Tool("python", python, {}, max_concurrency=python.max_concurrency)}
    limits = SandboxLimits(**request["limits"])
    cases = request["cases"]
    for case in cases:
        case["program"] = case["program"].replace("$trainer_pid", str(os.getpid()))
    cgroup_parent = runner._cgroup_parent()  # where the sandbox makes its cgroups, if anywhere
    start = time.monotonic()
    report = {"isolation": run_python("pass").isolation, "error": None, "block_s": [], "reward_s": [], "samples": []}
    report["samples"].append(resources(0, start, cgroup_parent))
    verdicts = []
    for first in range(0, len(cases), BLOCK):
        block = cases[first : first + BLOCK]
        reward = [i for i, case in enumerate(block) if case["route"] == "reward"]
        tool = [i for i, case in enumerate(block) if case["route"] == "tool"]
        block_verdicts = [None] * len(block)
        began = time.perf_counter()
        try:
            programs, tests = [block[i]["program"] for i in reward], [block[i]["tests"] for i in reward]
            scored = [reward_verdict(s) for s in code_reward(["p"] * len(reward), programs, tests=tests, limits=limits)]
        except Exception as exc:  # the contract is that it never raises for what a program does
            report["error"] = f"code_reward raised {type(exc).__name__}: {exc}"
            scored = ["raised"] * len(reward)
        report["reward_s"].append(time.perf_counter() - began)
        calls = [ToolCall("python", {"code": block[i]["program"]}) for i in tool]
        answered = [tool_verdict(r) for r in run_tool_calls(calls, tools, timeout_s=TOOL_TIMEOUT_S)]
        report["block_s"].append(time.perf_counter() - began)
        for i, verdict in zip(reward + tool, scored + answered):
            block_verdicts[i] = verdict
        verdicts += block_verdicts
        report["samples"].append(resources(first + len(block), start, cgroup_parent))
    report["verdicts"] = verdicts
    report["received"] = len(received)
    report["cgroup_parent"] = cgroup_parent
    print(json.dumps(report))


# ---------------------------------------------------------------- the caller's side: run, check, report


def ordinary_account() -> tuple[tuple, bool]:
    """test_sandbox's account as (uid, gid, groups, home), made with useradd if missing; and whether made."""
    import pwd

    from test_sandbox import ACCOUNT

    made = False
    try:
        entry = pwd.getpwnam(ACCOUNT)
    except KeyError:
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", ACCOUNT], check=True, capture_output=True)
        entry, made = pwd.getpwnam(ACCOUNT), True
    return (entry.pw_uid, entry.pw_gid, os.getgrouplist(ACCOUNT, entry.pw_gid), entry.pw_dir), made


def soak_caller(mode: str, account, n: int):
    """test_sandbox's Caller for `mode` ("root" or "account") whose one battery run is the soak of n programs."""
    from test_sandbox import Caller

    class SoakCaller(Caller):
        def run(self, request: dict) -> dict:
            self.cases, self.limits = workload(request, n), request["limits"]
            temp = tempfile.mkdtemp(prefix="grpo_fast_soak_")  # the worker's TMPDIR: its entries are counted
            os.chown(temp, self.uid, self.gid)
            try:
                done = subprocess.run(
                    [self.python, "-I", os.path.abspath(__file__), "--worker"],
                    input=json.dumps({"cases": self.cases, "limits": request["limits"]}),
                    env={
                        "PATH": os.environ.get("PATH", ""),
                        "TMPDIR": temp,
                        "GRPO_FAST_TEST_SECRET": request["secret"],
                        **self.env,
                    },
                    capture_output=True,
                    text=True,
                    cwd="/",
                    check=False,
                    **self.ids,
                )
            finally:
                shutil.rmtree(temp, ignore_errors=True)
            if done.returncode != 0:
                raise RuntimeError(f"the soak worker failed:\n{done.stderr[-4000:]}")
            self.report = json.loads(done.stdout.splitlines()[-1])
            # Scores are read per case from the report (`check`); the battery keeps the rest.
            return {
                "scores": [None] * len(request["names"]),
                "received": self.report["received"],
                "isolation": self.report["isolation"],
                "error": self.report["error"],
                "warnings": [],
            }

    return SoakCaller(mode, account, REPO)


def check(cases: list, report: dict, battery, n: int, tolerance: float) -> dict:
    """The soak's numbers and its guarantees (each {"pass": bool, ...}) from the worker's report and the battery."""
    verdicts = report["verdicts"]
    counts = {}
    for case, verdict in zip(cases, verdicts):
        kinds = counts.setdefault(case["route"], {}).setdefault(case["family"], {})
        kinds.setdefault(case["kind"], Counter())[verdict] += 1
    # A hostile reward program passes a test only when its attack worked; a tool call has no
    # verdict to forge, and a hostile tool program's own asserts could fool only themselves:
    # what such calls reach is the host check's.
    forged = [
        (c["route"], c["kind"], v)
        for c, v in zip(cases, verdicts)
        if (c["family"] == "hostile" and c["route"] == "reward" and v in ("pass", "partial"))
        or (c["family"] == "wrong" and v == "pass")
    ]
    honest_failed = [
        (c["route"], c["kind"], v) for c, v in zip(cases, verdicts) if c["family"] == "honest" and v != "pass"
    ]
    host = {
        "connections": battery.connections,
        "signals_to_the_caller": battery.pytest_signals,
        "signals_to_the_worker": battery.received,
        "processes_left": len(battery.processes),
        "files_left_outside": len(battery.leftovers),
        "caller_files_changed": battery.target_files
        != {"keep.txt": "original", "secret.txt": battery.secret, "victim.txt": "victim"}
        or battery.keep_mode == 0o777,
    }
    blocks = report["block_s"]
    per_500 = [
        {
            "programs": f"{k * BLOCK}-{min(k + 5, len(blocks)) * BLOCK}",
            "programs_per_s": round(len(blocks[k : k + 5]) * BLOCK / sum(blocks[k : k + 5]), 2),
        }
        for k in range(0, len(blocks), 5)
    ]
    window = max(1, n // 5 // BLOCK)  # blocks: 10 (1,000 programs) at N = 5,000; every block the same mix
    first, last = window * BLOCK / sum(blocks[:window]), window * BLOCK / sum(blocks[-window:])
    warm, end = report["samples"][1], report["samples"][-1]
    growth = {
        key: None if warm[key] is None else end[key] - warm[key]
        for key in ("fds", "threads", "children", "mounts", "temp_entries", "cgroups")
    }
    rss_growth = end["rss_bytes"] - warm["rss_bytes"]
    guarantees = {
        "no_forged_pass": {"pass": not forged, "forged": forged},
        "no_honest_failed": {"pass": not honest_failed, "failed": honest_failed},
        "host_untouched": {
            "pass": not any(host.values()) and report["error"] is None,
            **host,
            "code_reward_error": report["error"],
        },
        "throughput_steady": {
            "pass": last / first >= 1 - tolerance,
            "window_programs": window * BLOCK,
            "first_per_s": round(first, 2),
            "last_per_s": round(last, 2),
            "ratio": round(last / first, 3),
            "tolerance": tolerance,
        },
        "no_resource_growth": {
            "pass": all(g is None or g <= 0 for g in growth.values()),
            "from_programs": warm["programs"],
            **growth,
        },
        "rss_growth_under_50mb": {"pass": rss_growth < RSS_GROWTH_LIMIT, "growth_bytes": rss_growth},
    }
    return {"verdicts": counts, "throughput_per_500": per_500, "guarantees": guarantees}


def soak(mode: str, n: int, tolerance: float) -> dict:
    """One soak of n programs as `mode` ("root" or "user"): the worker's report, checked."""
    from test_sandbox import ACCOUNT, Battery

    # The caller's own ids stand for the account where it is no root (as in test_sandbox).
    account, made = (os.getuid(), os.getgid(), os.getgroups(), os.path.expanduser("~")), False
    if mode == "user" and os.geteuid() == 0:
        account, made = ordinary_account()
    signals = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: signals.append(signum))
    caller = soak_caller("root" if mode == "root" else "account", account, n)
    try:
        battery = Battery(caller, signals)
        try:
            result = check(caller.cases, caller.report, battery, n, tolerance)
        finally:
            battery.cleanup()
    finally:
        signal.signal(signal.SIGUSR1, previous)
        if made:
            subprocess.run(["userdel", "--remove", ACCOUNT], check=False, capture_output=True)
    return {
        "caller": mode,
        "uid": caller.uid,
        "python": caller.python,
        "isolation": caller.report["isolation"],
        "cgroup_parent": caller.report["cgroup_parent"],
        "programs": n,
        "block": BLOCK,
        "wall_s": round(sum(caller.report["block_s"]), 1),
        "reward_limits": caller.limits,
        **result,
        "block_s": [round(t, 2) for t in caller.report["block_s"]],
        "reward_s": [round(t, 2) for t in caller.report["reward_s"]],
        "samples": caller.report["samples"],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--programs", type=int, default=5000, help=f"a multiple of {BLOCK}")
    parser.add_argument("--as", dest="callers", choices=("root", "user", "both"), default="both")
    parser.add_argument("--out", help="the JSON's path (one caller only); default results/soak_sandbox_CALLER.json")
    parser.add_argument("--throughput-tolerance", type=float, default=THROUGHPUT_TOLERANCE)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker()
    if args.programs < BLOCK or args.programs % BLOCK:
        parser.error(f"-n must be a positive multiple of {BLOCK}, got {args.programs}")
    callers = ["root", "user"] if args.callers == "both" else [args.callers]
    if args.out and len(callers) > 1:
        parser.error("--out names one file: pick one caller with --as")
    for folder in ("tests", "benchmarks"):  # the battery (tests/test_sandbox.py) and the honest tasks
        sys.path.insert(0, os.path.join(REPO, folder))
    from common import machine_info  # torch: the caller's interpreter has it, the account's need not

    failed = []
    for caller in callers:
        result = {
            "machine": {
                **machine_info(),
                "host": os.uname().nodename,
                "kernel": os.uname().release,
                "commit": _commit(),
            },
            **soak(caller, args.programs, args.throughput_tolerance),
        }
        out = args.out or os.path.join(REPO, "benchmarks", "results", f"soak_sandbox_{caller}.json")
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        _print(result)
        print(f"wrote {out}")
        failed += [f"{caller}: {name}" for name, g in result["guarantees"].items() if not g["pass"]]
    if failed:
        sys.exit("guarantees failed: " + ", ".join(failed))


def _commit() -> str | None:
    found = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return found.stdout.strip() or None


def _print(result: dict) -> None:
    print(f"{result['caller']} ({result['isolation']}): {result['programs']} programs in {result['wall_s']} s")
    print("programs/s per 500:", " ".join(str(row["programs_per_s"]) for row in result["throughput_per_500"]))
    for route, families in result["verdicts"].items():
        for family, kinds in families.items():
            total = sum((Counter(v) for v in kinds.values()), Counter())
            print(f"  {route:6} {family:7} {dict(total)}")
    first, end = result["samples"][1], result["samples"][-1]
    print("after the first block:", {k: v for k, v in first.items() if k != "elapsed_s"})
    print("at the end:           ", {k: v for k, v in end.items() if k != "elapsed_s"})
    for name, g in result["guarantees"].items():
        print(f"  {'pass' if g['pass'] else 'FAIL'}  {name}")


if __name__ == "__main__":
    main()
