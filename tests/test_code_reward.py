"""code_reward: what it scores (assert lists, stdin/stdout pairs, HumanEval's check(), MBPP's
asserts with setup), how a program's exits, syntax errors and oversized replies count, the
judge's plain-data codec, a batch in parallel, and its errors for malformed tests.

The sandbox the programs run in is tests/test_sandbox.py's subject; these run in this
machine's default mode.
"""

import json
import textwrap
import threading
import time

import pytest
from _sandboxed import LIMITS, processes_with, score
from conftest import children

from grpo_fast.rewards import code, code_reward, extract_code
from grpo_fast.sandbox import SandboxLimits, _judge

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


def test_values_cross_as_plain_data_with_python_equality():
    code = textwrap.dedent("""
        import collections
        def f(kind):
            return {"tuple": (1, (2.5, "x")), "set": {1, 2}, "frozenset": frozenset({b"a"}), "dict": {(1, 2): [None]},
                    "complex": 1 + 2j, "bytearray": bytearray(b"z"), "nan": float("nan"), "big": 2**100,
                    "counter": collections.Counter("aab"), "bool": True}[kind]
        limit = 10
        def fails():
            raise ValueError("no")
    """)
    tests = [
        "assert f('tuple') == (1, (2.5, 'x')) and type(f('tuple')) is tuple",
        "assert f('set') == {1, 2}",
        "assert f('frozenset') == frozenset({b'a'})",
        "assert f('dict') == {(1, 2): [None]}",
        "assert f('complex') == 1 + 2j",
        "assert f('bytearray') == bytearray(b'z')",
        "assert math.isnan(f('nan'))",
        "assert f('big') == 2**100",
        "assert f('counter') == {'a': 2, 'b': 1}",
        "assert f('bool') == 1 and f('bool') is True",
        "assert limit == 10",
        "try:\n    fails()\nexcept ValueError:\n    pass\nelse:\n    raise AssertionError",
    ]
    assert score(code, tests) == 1.0


def test_extract_code_takes_the_last_fenced_block():
    text = "```python\nx = 1\n```\nthen\n```py\nx = 2\n```"
    assert extract_code(text) == "x = 2\n"
    assert extract_code("x = 3") == "x = 3"
    assert extract_code("```Python3\r\ny = 1\r\n```") == "y = 1\r\n"


# ---------------------------------------------------------------- HumanEval and MBPP formats

# Three problems in HumanEval's shape (prompt, canonical solution, test with
# METADATA and check(candidate), entry point), written for these tests.
HUMANEVAL = [
    {
        "prompt": "from typing import List\n\n\ndef running_max(numbers: List[int]) -> List[int]:\n"
        '    """The largest element seen so far, at each position.\n'
        '    >>> running_max([1, 3, 2])\n    [1, 3, 3]\n    """\n',
        "canonical_solution": "    out, best = [], None\n    for x in numbers:\n"
        "        best = x if best is None else max(best, x)\n        out.append(best)\n"
        "    return out\n",
        "wrong_solution": "    return sorted(numbers)\n",
        "test": "\n\nMETADATA = {'author': 'grpo_fast'}\n\n\ndef check(candidate):\n"
        "    assert candidate([]) == []\n    assert candidate([1, 3, 2]) == [1, 3, 3]\n"
        "    assert candidate([5, 4, 3]) == [5, 5, 5]\n    assert candidate([-1, 0, -2, 7]) == [-1, 0, 0, 7]\n",
        "entry_point": "running_max",
    },
    {
        # check() uses a helper of the prompt, as HumanEval's encode/decode problems do.
        "prompt": "def encode_shift(s: str) -> str:\n"
        "    return ''.join(chr((ord(c) - ord('a') + 3) % 26 + ord('a')) for c in s)\n\n\n"
        'def decode_shift(s: str) -> str:\n    """Inverse of encode_shift."""\n',
        "canonical_solution": "    return ''.join(chr((ord(c) - ord('a') - 3) % 26 + ord('a')) for c in s)\n",
        "wrong_solution": "    return s[::-1]\n",
        "test": "\n\nMETADATA = {}\n\n\ndef check(candidate):\n    import random\n    rng = random.Random(7)\n"
        "    for _ in range(20):\n"
        "        word = ''.join(rng.choice('abcdefghijklmnopqrstuvwxyz') for _ in range(rng.randint(1, 12)))\n"
        "        assert candidate(encode_shift(word)) == word\n",
        "entry_point": "decode_shift",
    },
    {
        "prompt": "def mean_distance(xs: list, center: float) -> float:\n"
        '    """Mean absolute distance of xs from center."""\n',
        "canonical_solution": "    return sum(abs(x - center) for x in xs) / len(xs)\n",
        "wrong_solution": "    return max(abs(x - center) for x in xs)\n",
        "test": "\n\ndef check(candidate):\n    assert abs(candidate([1.0, 2.0, 3.0], 2.0) - 2 / 3) < 1e-6\n"
        "    assert abs(candidate([0.5], 0.0) - 0.5) < 1e-6\n"
        "    assert abs(candidate([1.0, -1.0, 4.0], 0.0) - 2.0) < 1e-6\n",
        "entry_point": "mean_distance",
    },
]


def test_humaneval_canonical_scores_one_and_wrong_zero():
    """Both forms: HumanEval's columns (`tests` = its test source, `entry_point`, `setup` = its
    prompt), and one self-contained dict per row."""
    n = len(HUMANEVAL)
    for solution in ("canonical_solution", "wrong_solution"):
        completions = [f"```python\n{p['prompt']}{p[solution]}```" for p in HUMANEVAL]
        expected = [1.0 if solution == "canonical_solution" else 0.0] * n
        columns = code_reward(
            ["p"] * n,
            completions,
            tests=[p["test"] for p in HUMANEVAL],
            limits=LIMITS,
            entry_point=[p["entry_point"] for p in HUMANEVAL],
            setup=[p["prompt"] for p in HUMANEVAL],
        )
        rows = code_reward(
            ["p"] * n,
            completions,
            limits=LIMITS,
            tests=[{"test": p["test"], "entry_point": p["entry_point"], "setup": p["prompt"]} for p in HUMANEVAL],
        )
        assert columns == expected and rows == expected, solution


def test_humaneval_helpers_from_setup_stay_trusted():
    """A completion that redefines the prompt's helper cannot make check() pass with it."""
    problem = HUMANEVAL[1]
    cheat = "def encode_shift(s):\n    return s\n\ndef decode_shift(s):\n    return s\n"
    tests = {"test": problem["test"], "entry_point": "decode_shift", "setup": problem["prompt"]}
    assert score(cheat, tests) == 0.0
    assert score(problem["prompt"] + problem["canonical_solution"], tests) == 1.0


def test_mbpp_asserts_with_setup_and_entry_point():
    code = "def circle_area(r):\n    return 3.141592653589793 * r * r\n"
    tests = {
        "asserts": ["assert math.isclose(circle_area(2), 12.566370614359172)", "assert isclose(circle_area(1), pi)"],
        "setup": "from math import isclose, pi",
        "entry_point": "circle_area",
    }
    assert score(code, tests) == 1.0
    # With an entry point, a stub of that name in setup is the program's, not the stub.
    stubbed = {**tests, "setup": tests["setup"] + "\ndef circle_area(r):\n    return 0.0\n"}
    assert score(code, stubbed) == 1.0


def test_exceptions_that_end_iterations_do_not_pass():
    """StopIteration from the program would end `map` early and make `all(...)` true."""
    code = "def f(x):\n    raise StopIteration\n"
    assert score(code, ["assert all(map(lambda x: f(x) == x, [1, 2, 3]))"]) == 0.0


def test_malformed_tests_raise_naming_the_sample():
    with pytest.raises(ValueError, match=r"tests\[0\].*entry_point"):
        code_reward(["p"], ["x = 1"], tests=[HUMANEVAL[0]["test"]])
    with pytest.raises(ValueError, match=r"tests\[0\].*not valid Python"):
        code_reward(["p"], ["x = 1"], tests=[["assert (1"]])
    with pytest.raises(ValueError, match=r"tests\[0\].*check"):
        code_reward(["p"], ["x = 1"], tests=[{"test": "x = 1", "entry_point": "f"}])
    # With an entry point the program supplies nothing else: a helper the tests need must be in setup.
    with pytest.raises(ValueError, match=r"tests\[0\].*\['encode_shift'\].*setup"):
        code_reward(["p"], ["x = 1"], tests=[{"test": HUMANEVAL[1]["test"], "entry_point": "decode_shift"}])
    with pytest.raises(ValueError, match=r"tests\[0\].*\['helper'\]"):
        code_reward(["p"], ["x = 1"], tests=[{"asserts": ["assert f(1) == helper(1)"], "entry_point": "f"}])
    with pytest.raises(ValueError, match=r"tests\[0\].*both"):
        code_reward(["p"], ["x = 1"], tests=[{"asserts": ["assert True"], "entry_point": "f"}], entry_point=["g"])


def test_a_group_shares_one_prepared_tests_object(monkeypatch):
    """The rollout repeats a row's tests object for its G samples: it is parsed once, and a
    sample with its own (equal) object, or another entry point, gets its own."""
    prepared = []
    normalize = code.normalize_tests
    monkeypatch.setattr(code, "normalize_tests", lambda *args: prepared.append(args) or normalize(*args))
    # every test passes: a job (program, spec, case) returns how many
    monkeypatch.setattr(code, "_run_job", lambda job, limits, require_isolation: code._test_count(job[1]))
    shared = ["assert f() == 1", "assert f() != 2"]
    tests = [shared] * 3 + [list(shared), shared]
    scores = code_reward(["p"] * 5, ["x = 1"] * 5, tests=tests, entry_point=[None] * 4 + ["f"])
    assert scores == [1.0] * 5
    assert [args[1] for args in prepared] == [None, None, "f"]


def test_broken_trusted_tests_raise_rather_than_score_zero():
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        score("def f():\n    return 1\n", {"asserts": ["assert f() == 1"], "setup": "1 / 0"})


def test_codec_round_trip_and_rejects_anything_else():
    values = [
        None,
        True,
        -3,
        2.5,
        float("inf"),
        "é",
        b"\x00",
        bytearray(b"a"),
        1j,
        [1, [2]],
        (1, (2,)),
        {1, 2},
        frozenset({"a"}),
        {(1, "x"): {"k": [None]}},
    ]
    for value in values:
        decoded = _judge.decode(json.loads(json.dumps(_judge.encode(value))))
        assert decoded == value and type(decoded) is type(value)
    too_deep = []
    for _ in range(_judge.MAX_DEPTH + 1):
        too_deep = [too_deep]
    for junk in [
        {"tuple": 1},
        {"set": [[1]]},
        {"dict": [[[1], 2]]},
        {"x": []},
        {"tuple": [], "set": []},
        {"bytes": 3},
        {"complex": ["a", 1]},
        too_deep,
    ]:
        with pytest.raises(ValueError):
            _judge.decode(junk)
    with pytest.raises(TypeError):
        _judge.encode(lambda: 0)


# ---------------------------------------------------------------- exits and replies


def test_a_reply_larger_than_the_output_limit_fails():
    code = "def f():\n    return 'x' * (1 << 20)\ndef g():\n    return 1\n"
    assert score(code, ["assert len(f()) == 1 << 20", "assert g() == 1"]) == 0.0


@pytest.mark.parametrize("exit_call", ["sys.exit(0)", "os._exit(0)", "raise SystemExit", "raise KeyboardInterrupt"])
def test_exit_before_or_during_the_tests_scores_only_what_passed(exit_call):
    code = f"import os, sys\n{exit_call}\n"
    assert score(code, ["assert True", "assert 1 + 1 == 2"]) == 0.0
    during = f"import os, sys\ndef f():\n    {exit_call}\ndef g():\n    return 1\n"
    assert score(during, ["assert g() == 1", "assert f() == 1", "assert g() == 1"]) == pytest.approx(1 / 3)


def test_a_sandbox_killed_from_outside_scores_zero_at_once():
    """The sandbox's process SIGKILLed by someone else (the OOM killer, an operator) while its
    program sleeps: the sample scores 0 as soon as it dies, not after the program's time, and
    code_reward does not raise: a program can bring on its own death, so a death is never the
    run's error."""
    import os
    import signal

    def running_sandboxes() -> list:
        """This process's children that run the sandbox's bootstrap and have forked the program:
        a bootstrap killed before it forks never started the program, a setup failure that
        code_reward reports, not the death of a program."""
        mine = set(children(os.getpid()))
        return [pid for pid in processes_with("_boot.main()") if pid in mine and children(pid)]

    killed = []

    def kill_the_sandbox():
        deadline = time.monotonic() + 10
        while not killed and time.monotonic() < deadline:
            for pid in running_sandboxes():
                os.kill(pid, signal.SIGKILL)
                killed.append(time.monotonic())
            time.sleep(0.05)

    killer = threading.Thread(target=kill_the_sandbox)
    killer.start()
    program = "import time\ntime.sleep(30)\ndef add(a, b):\n    return a + b\n"
    assert code_reward(["p"], [program], tests=[["assert add(1, 2) == 3"]]) == [0.0]
    done = time.monotonic()
    killer.join()
    assert killed and done - killed[0] < 5


def test_syntax_error_scores_zero():
    assert score("def f(:\n    return 1\n", ["assert True"]) == 0.0
    assert score("def f(:\n", [{"input": "", "output": ""}]) == 0.0


# ---------------------------------------------------------------- parallel runs


def test_batch_runs_in_parallel_with_per_sample_results(monkeypatch):
    in_flight, most = [0], [0]
    lock = threading.Lock()
    run_judged = code.run_judged

    def counted(*args, **kwargs):
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        try:
            return run_judged(*args, **kwargs)
        finally:
            with lock:
                in_flight[0] -= 1

    monkeypatch.setattr(code, "run_judged", counted)
    sleeper = "import time\ntime.sleep(0.6)\ndef f():\n    return {}\n"
    completions = [sleeper.format(i) for i in range(4)] + ["while True:\n    pass\n", "def f(:\n"]
    tests = [[f"assert f() == {i}"] for i in range(4)] + [["assert True"], ["assert True"]]
    limits = SandboxLimits(wall_time_s=2.0, memory_bytes=256 << 20, max_processes=8)
    start = time.monotonic()
    rewards = code_reward(["p"] * 6, completions, tests=tests, limits=limits, max_workers=6)
    assert rewards == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    # The loop holds its sandbox for its whole 2 s limit while the sleepers run beside it.
    assert most[0] >= 2, f"at most {most[0]} sandbox at a time; the batch took {time.monotonic() - start:.1f} s"


# ---------------------------------------------------------------- bad input


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="tests"):
        code_reward(["p", "q"], ["x = 1", "x = 2"], tests=[["assert x"]])
    with pytest.raises(TypeError, match=r"tests\[0\]"):
        code_reward(["p"], ["x = 1"], tests=[["assert x", {"input": "1", "output": "1"}]])
