"""code_reward and its sandbox: correct scores, and every attack of the issue scores 0 and
leaves no trace.

Each attack program records whether its attack worked, and its test asserts that it did:
a working attack would score 1.0, so "reward 0" means "the sandbox stopped it". The attacks
are bounded so that a broken sandbox could not harm the machine either: the fork bomb stops
at 300 sleeping processes (killed by pid in `finally`), the memory bomb asks for 1 GiB of
untouched pages, the huge print writes 20 MB, files are touched only under tmp_path, and
the signal sent to this test process is SIGUSR1, caught here.
"""

import os
import signal
import socket
import time

import pytest

from grpo_fast.rewards import SandboxLimits, code_reward, extract_code, run_python

LIMITS = SandboxLimits(wall_time_s=2.0, memory_bytes=256 << 20, max_processes=16, output_bytes=64 << 10)
ROOT = os.geteuid() == 0


@pytest.fixture(params=["isolated", "unprivileged"])
def sandbox_mode(request, monkeypatch):
    """Run an attack with full isolation (root) and with the fallback a non-root caller gets.

    The fallback runs as the caller; as root here, RLIMIT_NPROC, file permissions and signal
    permissions do not stop it, so the tests check those only in the isolated mode.
    """
    if request.param == "isolated" and not ROOT:
        pytest.skip("full isolation needs root")
    if request.param == "unprivileged":
        monkeypatch.setenv("GRPO_FAST_SANDBOX_UNPRIVILEGED", "1")
    assert score("x = 1\n", ["assert x == 1"]) == 1.0  # the mode works at all
    return request.param


def score(code: str, tests, limits: SandboxLimits = LIMITS) -> float:
    return code_reward(["prompt"], [code], tests=[tests], limits=limits)[0]


def processes_with(marker: str) -> list[int]:
    """Pids whose command line contains `marker`."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


# ---------------------------------------------------------------- scoring


def test_assert_tests_score_the_fraction_passed():
    completion = "Here is my solution:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."
    tests = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 5", "assert add('a', 'b') == 'ab'"]
    assert score(completion, tests) == 0.75


def test_io_tests_compare_stdout():
    code = "n = int(input())\nprint(n * 2)  \n"  # trailing spaces and newline are not significant
    tests = [{"input": "3\n", "output": "6"}, {"input": "5", "output": "10\n"}, {"input": "1", "output": "3"}]
    assert score(code, tests) == pytest.approx(2 / 3)
    assert score(code, {"inputs": ["2", "4"], "outputs": ["4", "8"]}) == 1.0


def test_json_encoded_tests_and_missing_tests():
    code = "def sq(x):\n    return x * x\n"
    rewards = code_reward(["p"] * 3, [code] * 3, tests=['["assert sq(3) == 9"]', None, []], limits=LIMITS)
    assert rewards == [1.0, None, None]


def test_program_may_use_its_scratch_dir_and_stdlib():
    code = (
        "import json, os, re, collections\n"
        "with open('notes.txt', 'w') as f:\n    f.write('kept')\n"
        "assert os.listdir('.') == ['notes.txt'] or sorted(os.listdir('.'))\n"
        "def read():\n    return open('notes.txt').read()\n"
    )
    assert score(code, ["assert read() == 'kept'"]) == 1.0


def test_extract_code_takes_the_last_fenced_block():
    text = "```python\nx = 1\n```\nthen\n```py\nx = 2\n```"
    assert extract_code(text) == "x = 2\n"
    assert extract_code("x = 3") == "x = 3"
    assert extract_code("```Python3\r\ny = 1\r\n```") == "y = 1\r\n"


def test_run_python_isolation_facts():
    result = run_python(
        "import os, sys\nprint(os.getuid(), os.getcwd(), sorted(os.listdir('.')), sorted(os.environ))\n"
        "print(sys.stdin.read())",
        files={"data.txt": "x"}, stdin="hello", limits=LIMITS,
    )
    assert result.ok, result
    uid, cwd, listing, env_keys = result.stdout.splitlines()[0].split(" ", 3)
    assert listing == "['data.txt']"
    assert env_keys == "['HOME', 'LANG', 'PATH']"
    assert result.stdout.splitlines()[1] == "hello"
    if ROOT:
        assert result.isolated and int(uid) != 0 and cwd == "/tmp"


# ---------------------------------------------------------------- attacks


def test_infinite_loop_is_killed_at_the_wall_limit(sandbox_mode):
    limits = SandboxLimits(wall_time_s=1.0, max_processes=16)
    start = time.monotonic()
    assert score("def f():\n    return 1\nwhile True:\n    pass\n", ["assert f() == 1"], limits) == 0.0
    assert time.monotonic() - start < 1.0 + 5.0


def test_fork_bomb_is_capped_and_leaves_no_process(sandbox_mode):
    marker = f"9{os.getpid() % 1000}.{time.time_ns() % 10**6}"  # a unique `sleep` argument
    code = (
        "import os\nmade = 0\n"
        "for _ in range(300):\n"
        "    try:\n        pid = os.fork()\n    except OSError:\n        break\n"
        "    if pid == 0:\n"
        "        try:\n            os.setsid()  # try to leave the process group as well\n"
        f"        finally:\n            os.execv('/bin/sleep', ['sleep', '{marker}'])\n"
        "    made += 1\n"
    )
    try:
        reward = score(code, ["assert made >= 300"])
        assert processes_with(marker) == []  # also those that called setsid()
        if sandbox_mode == "isolated":
            assert reward == 0.0
    finally:
        for pid in processes_with(marker):
            os.kill(pid, signal.SIGKILL)


def test_memory_bomb_fails(sandbox_mode):
    assert score("data = bytearray(1 << 30)\n", ["assert len(data) == 1 << 30"]) == 0.0


def test_huge_print_is_cut_at_the_output_limit(sandbox_mode):
    code = "for _ in range(200):\n    print('x' * 100_000)\ndef f():\n    return 1\n"
    assert score(code, ["assert f() == 1"]) == 0.0
    result = run_python(code, limits=LIMITS)
    # Python ignores SIGXFSZ, so the write past RLIMIT_FSIZE fails with EFBIG instead.
    assert not result.ok and "File too large" in result.stderr
    assert len(result.stdout) <= LIMITS.output_bytes


@pytest.mark.skipif(not ROOT, reason="the size-capped scratch tmpfs needs full isolation")
def test_disk_filling_stops_at_the_scratch_size():
    limits = SandboxLimits(wall_time_s=2.0, output_bytes=1 << 20, scratch_bytes=8 << 20)
    code = "written = 0\ntry:\n    for i in range(64):\n        open(f'f{i}', 'wb').write(bytes(1 << 20))\n" \
           "        written += 1\nexcept OSError:\n    pass\n"
    assert score(code, ["assert written == 64"], limits) == 0.0
    assert score(code, ["assert 4 <= written < 8"], limits) == 1.0


@pytest.mark.skipif(not ROOT, reason="without root the program has the caller's file permissions")
def test_files_outside_the_scratch_dir_are_untouched(tmp_path):
    keep, victim, created = tmp_path / "keep.txt", tmp_path / "delete_me.txt", tmp_path / "created.txt"
    keep.write_text("original")
    victim.write_text("victim")
    escape = f"/tmp/grpo_fast_escape_{os.getpid()}"
    code = (
        "import os\ndone = []\n"
        f"for action in (lambda: open({str(keep)!r}, 'w').write('pwned'), lambda: os.remove({str(victim)!r}),\n"
        f"               lambda: open({str(created)!r}, 'w').write('new')):\n"
        "    try:\n        action()\n        done.append(True)\n    except OSError:\n        pass\n"
        f"open({escape!r}, 'w').write('escaped')  # /tmp inside the sandbox is its scratch dir\n"
    )
    try:
        assert score(code, ["assert done"]) == 0.0
        assert keep.read_text() == "original" and victim.exists() and not created.exists()
        assert not os.path.exists(escape)
    finally:
        if os.path.exists(escape):
            os.remove(escape)


def test_environment_secrets_are_not_inherited(sandbox_mode, monkeypatch):
    monkeypatch.setenv("GRPO_FAST_TEST_SECRET", "hunter2")
    code = "import os\nleaked = os.environ.get('GRPO_FAST_TEST_SECRET')\n"
    assert score(code, ["assert leaked == 'hunter2'"]) == 0.0


def test_network_is_unreachable(sandbox_mode):
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    code = (
        "import socket\nconnected = False\n"
        f"try:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1).close()\n    connected = True\n"
        "except OSError:\n    pass\n"
    )
    try:
        assert score(code, ["assert connected"]) == 0.0
        with pytest.raises(socket.timeout):
            server.accept()
    finally:
        server.close()


@pytest.mark.skipif(not ROOT, reason="without root the program may signal the caller's processes")
def test_killing_its_parent_or_the_caller_fails():
    received = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: received.append(signum))
    code = (
        "import os, signal\nhits = 0\n"
        f"for pid in ({os.getpid()}, os.getppid()):\n"
        "    try:\n        os.kill(pid, signal.SIGUSR1 if pid != os.getppid() else signal.SIGKILL)\n        hits += 1\n"
        "    except OSError:\n        pass\n"
    )
    try:
        assert score(code, ["assert hits == 2"]) == 0.0
        time.sleep(0.1)
        assert received == []
        assert score("x = 1\n", ["assert x == 1"]) == 1.0  # the sandbox still works
    finally:
        signal.signal(signal.SIGUSR1, previous)


@pytest.mark.parametrize("exit_call", ["sys.exit(0)", "os._exit(0)", "raise SystemExit"])
def test_exit_before_the_tests_run_scores_zero(sandbox_mode, exit_call):
    code = f"import os, sys\n{exit_call}\n"
    assert score(code, ["assert True", "assert 1 + 1 == 2"]) == 0.0


def test_syntax_error_scores_zero(sandbox_mode):
    assert score("def f(:\n    return 1\n", ["assert True"]) == 0.0
    assert score("def f(:\n", [{"input": "", "output": ""}]) == 0.0


def test_forged_report_from_a_forked_child_is_ignored(sandbox_mode):
    code = "import os\nif os.fork() == 0:\n    pass\nelse:\n    os.wait()\n    raise RuntimeError('parent fails')\n"
    assert score(code, ["assert True"]) == 0.0


# ---------------------------------------------------------------- parallel runs


def test_batch_runs_in_parallel_with_per_sample_results():
    sleeper = "import time\ntime.sleep(0.6)\ndef f():\n    return {}\n"
    completions = [sleeper.format(i) for i in range(4)] + ["while True:\n    pass\n", "def f(:\n"]
    tests = [[f"assert f() == {i}"] for i in range(4)] + [["assert True"], ["assert True"]]
    limits = SandboxLimits(wall_time_s=2.0, max_processes=16)
    start = time.monotonic()
    rewards = code_reward(["p"] * 6, completions, tests=tests, limits=limits, max_workers=6)
    elapsed = time.monotonic() - start
    assert rewards == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    # Sequentially: 4 * 0.6 s + 2 s for the loop = 4.4 s. In parallel: bounded by the loop's 2 s.
    assert elapsed < 3.5, elapsed


# ---------------------------------------------------------------- bad input


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="wall_time_s"):
        SandboxLimits(wall_time_s=0)
    with pytest.raises(ValueError, match="tests"):
        code_reward(["p", "q"], ["x = 1", "x = 2"], tests=[["assert x"]])
    with pytest.raises(TypeError, match=r"tests\[0\]"):
        code_reward(["p"], ["x = 1"], tests=[["assert x", {"input": "1", "output": "1"}]])
    with pytest.raises(TypeError, match="program"):
        run_python(b"print(1)")


def test_a_sandbox_that_cannot_start_is_an_error_not_a_zero(tmp_path, monkeypatch):
    from grpo_fast.rewards import sandbox

    broken = tmp_path / "boot.py"
    broken.write_text("import sys\nsys.exit('cannot unshare')\n")
    monkeypatch.setattr(sandbox, "_BOOT", str(broken))
    with pytest.raises(RuntimeError, match="could not start.*cannot unshare"):
        score("x = 1\n", ["assert x == 1"])
    if ROOT:
        monkeypatch.setattr(sandbox, "UID_BASE", 2**32 - 1)  # (uid_t)-1 would keep root
        with pytest.raises(ValueError, match="uid"):
            run_python("print(1)")
