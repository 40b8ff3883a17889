"""Code reward: run each completion's program against its tests in the sandbox.

Reward = fraction of the tests passed. Tests per completion are either
  - assert statements: a list of str (MBPP / HumanEval style), run after the solution in
    its namespace, all in one sandboxed process; or
  - input/expected-output pairs: a list of {"input": str, "output": str}, or a dict
    {"inputs": [...], "outputs": [...]} (APPS / TACO style); one sandboxed run per pair,
    stdout compared with the expected output line by line, trailing whitespace ignored.
A JSON string of either form is decoded first (CSV and JSONL columns often hold one).
"""

import json
import os
import re
import secrets
from concurrent.futures import ThreadPoolExecutor

from grpo_fast.rewards.base import check_batch
from grpo_fast.rewards.sandbox import SandboxLimits, run_python

with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_code_harness.py")) as _f:
    _HARNESS = _f.read()

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\r?\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(completion: str) -> str:
    """The last fenced ```python (or ```py, or bare ```) block of `completion`, else the whole text."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def normalize_tests(tests) -> tuple[str, list] | None:
    """Returns ("assert", [statements]) or ("io", [(input, output)]), or None for no tests."""
    if isinstance(tests, str):
        stripped = tests.strip()
        if not stripped:
            return None
        tests = json.loads(stripped) if stripped[0] in "[{" else [tests]
    if tests is None:
        return None
    if isinstance(tests, dict):
        if set(tests) >= {"inputs", "outputs"} and len(tests["inputs"]) == len(tests["outputs"]):
            tests = [{"input": i, "output": o} for i, o in zip(tests["inputs"], tests["outputs"])]
        else:
            raise ValueError(f"tests as a dict must be {{'inputs': [...], 'outputs': [...]}} of equal length, "
                             f"got keys {sorted(tests)}")
    if not isinstance(tests, (list, tuple)):
        raise TypeError(f"tests must be a list of assert strings or of {{'input', 'output'}} dicts, "
                        f"got {type(tests).__name__}")
    if not tests:
        return None
    if all(isinstance(t, str) for t in tests):
        return "assert", list(tests)
    if all(isinstance(t, dict) and {"input", "output"} <= set(t) for t in tests):
        return "io", [(str(t["input"]), str(t["output"])) for t in tests]
    raise TypeError("tests must be all assert strings or all {'input': str, 'output': str} dicts, got a mix "
                    f"of {sorted({type(t).__name__ for t in tests})}")


def _same_output(got: str, expected: str) -> bool:
    lines = lambda s: [line.rstrip() for line in s.rstrip().splitlines()]  # noqa: E731
    return lines(got) == lines(expected)


def _checked(result):
    """A sandbox that cannot start programs is a setup problem, not a wrong answer: say so."""
    if result.error is not None:
        raise RuntimeError(f"the code sandbox could not start the program: {result.error}")
    return result


def _run_job(job, limits: SandboxLimits) -> float:
    """One sandboxed run; returns the number of tests it passed."""
    mode, code, payload = job
    if mode == "assert":
        nonce = secrets.token_hex(16)
        result = _checked(run_python(_HARNESS, files={"solution.py": code, "tests.json": json.dumps(payload)},
                                     args=("assert", nonce), limits=limits))
        if result.timed_out:
            return 0
        reports = re.findall(rf"^{nonce} (\d+)$", result.stdout, re.MULTILINE)
        return min(int(reports[-1]), len(payload)) if reports else 0
    test_input, expected = payload
    result = _checked(run_python(_HARNESS, files={"solution.py": code}, stdin=test_input, args=("io", ""),
                                 limits=limits))
    return float(result.ok and _same_output(result.stdout, expected))


def code_reward(prompts: list[str], completions: list[str], tests: list, *, limits: SandboxLimits | None = None,
                max_workers: int | None = None, **columns) -> list[float | None]:
    """Fraction of each completion's tests that its program passes, run in the sandbox.

    prompts, completions: N strings. The program is the last fenced Python block of the
        completion (or the whole completion).
    tests: N test specs (see the module docstring); None or empty scores None.
    limits: SandboxLimits for each run (default 4 s wall, 512 MiB, 32 processes, 1 MiB output).
    max_workers: parallel sandboxes (default: the CPU cores available to this process).
    Returns N floats in [0, 1] or None. Pass limits/max_workers with functools.partial.
    Example:
        >>> code_reward(["add"], ["```python\\ndef add(a, b):\\n    return a + b\\n```"],
        ...             tests=[["assert add(1, 2) == 3", "assert add(0, 0) == 1"]])
        [0.5]
    """
    n = check_batch(prompts, completions, {"tests": tests, **columns})
    limits = limits or SandboxLimits()
    specs = []
    for i, t in enumerate(tests):
        try:
            specs.append(normalize_tests(t))
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"tests[{i}]: {exc}") from exc
    jobs, owners = [], []
    for i, spec in enumerate(specs):
        if spec is None:
            continue
        mode, cases = spec
        code = extract_code(completions[i])
        if mode == "assert":
            jobs.append(("assert", code, cases))
            owners.append(i)
        else:
            jobs.extend(("io", code, case) for case in cases)
            owners.extend([i] * len(cases))
    workers = max(1, min(max_workers or len(os.sched_getaffinity(0)), len(jobs) or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        passed = list(pool.map(lambda job: _run_job(job, limits), jobs))
    totals = [0.0] * n
    for i, p in zip(owners, passed):
        totals[i] += p
    return [None if spec is None else totals[i] / len(spec[1]) for i, spec in enumerate(specs)]
