"""Code reward: run each completion's program in the sandbox, and its tests outside it.

Reward = fraction of the tests passed. Tests per completion (`tests[i]`) take one of four forms:
  - assert statements (MBPP style): a list of str, each one test, e.g.
    ["assert add(1, 2) == 3", "assert add(0, 0) == 0"];
  - HumanEval's `test` source, which defines `check(candidate)`, with the function's name in
    the `entry_point` column (HumanEval's own); one test: check(entry point) must not raise;
  - a dict {"test": source, "entry_point": name} (HumanEval, self-contained), or
    {"asserts": [...]} (MBPP), either with an optional "setup" and "entry_point";
  - input/expected-output pairs (APPS / TACO style): a list of {"input": str, "output": str},
    or a dict {"inputs": [...], "outputs": [...]}; one sandboxed run per pair, stdout
    compared with the expected output line by line, trailing whitespace ignored.
A JSON string of the list and dict forms is decoded first (CSV and JSONL columns often hold one).

`setup` (a dict key, or the `setup` column) is trusted source run before the program, in
the sandbox and in the judge: HumanEval's `prompt` (its helpers, such as `poly`, then stay
trusted when `check` uses them) or MBPP's `test_imports`. `entry_point` (a dict key, or the
`entry_point` column) names the function under test. With an entry point, it is the only
name the tests take from the program: every other name they use must be a builtin, one of a
few standard modules, or defined by the tests or `setup` (a ValueError says which is
missing, rather than letting the program define, say, the `poly` that checks it). Without
one (assert lists), the names the tests use and do not define come from the program.

The verdict is made outside the sandbox (`grpo_fast.sandbox`'s judge): the program only answers calls
of its functions with plain values, and the tests, with their expected values, run in the
trusted bootstrap. Whatever the program does to its own interpreter or output, it scores
only the tests its answers pass.
"""

import ast
import builtins
import json
import os
import re
import symtable
from concurrent.futures import ThreadPoolExecutor

from grpo_fast.rewards.base import check_batch, completion_texts
from grpo_fast.sandbox import JUDGE_MODULES, SandboxLimits, SandboxResult, run_judged, run_python

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\r?\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(completion: str) -> str:
    """The last fenced ```python (or ```py, or bare ```) block of `completion`, else the whole text."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def normalize_tests(tests, entry_point: str | None = None, setup: str | None = None) -> dict | None:
    """One sample's tests (any form of the module docstring) as a spec, or None for no tests.

    Returns {"kind": "asserts", "asserts": [str], ...} or {"kind": "check", "test": str, ...},
    both with "setup": str, "entry_point": str | None (never None for "check") and "names":
    the names the tests read; or {"kind": "io", "cases": [(input, output)]}. Raises ValueError
    or TypeError for tests that cannot run (a syntax error, HumanEval source without an entry
    point, a helper the tests need and do not define, a mix of forms).
    """
    if isinstance(tests, str):
        stripped = tests.strip()
        if not stripped:
            return None
        if stripped[0] in "[{":
            tests = json.loads(stripped)
        elif entry_point is not None or "check" in _top_level_functions(_parse(tests, "tests")):
            tests = {"test": tests}
        else:
            tests = [tests]
    if tests is None:
        return None
    if isinstance(tests, dict):
        if set(tests) >= {"inputs", "outputs"} and len(tests["inputs"]) == len(tests["outputs"]):
            tests = [{"input": i, "output": o} for i, o in zip(tests["inputs"], tests["outputs"])]
        elif len({"test", "asserts"} & set(tests)) == 1 and set(tests) <= {"test", "asserts", "entry_point", "setup"}:
            entry_point = _one_of("entry_point", tests.get("entry_point"), entry_point)
            setup = _one_of("setup", tests.get("setup"), setup)
            if "test" in tests:
                return _check_spec(tests["test"], entry_point, setup)
            tests = tests["asserts"]
            if not isinstance(tests, (list, tuple)) or not all(isinstance(t, str) for t in tests):
                raise TypeError("tests['asserts'] must be a list of assert strings")
        else:
            raise ValueError(
                f"tests as a dict must be {{'inputs': [...], 'outputs': [...]}} of equal length, "
                f"{{'test': source, 'entry_point': name}} or {{'asserts': [...]}} (each with an optional "
                f"'setup'), got keys {sorted(tests)}"
            )
    if not isinstance(tests, (list, tuple)):
        raise TypeError(
            f"tests must be a list of assert strings or of {{'input', 'output'}} dicts, got {type(tests).__name__}"
        )
    if not tests:
        return None
    if all(isinstance(t, str) for t in tests):
        trees = [_parse(statement, f"assert statement {j}") for j, statement in enumerate(tests)]
        spec = {
            "kind": "asserts",
            "asserts": list(tests),
            "setup": _checked_setup(setup),
            "entry_point": _checked_entry_point(entry_point, required=False),
            "names": _names_read(trees),
        }
        if spec["entry_point"] is not None:
            _check_names(spec, "\n".join(tests), "the assert statements")
        return spec
    if all(isinstance(t, dict) and {"input", "output"} <= set(t) for t in tests):
        if setup is not None or entry_point is not None:
            raise ValueError("setup and entry_point apply to assert and HumanEval tests, not to input/output pairs")
        return {"kind": "io", "cases": [(str(t["input"]), str(t["output"])) for t in tests]}
    raise TypeError(
        "tests must be all assert strings or all {'input': str, 'output': str} dicts, got a mix "
        f"of {sorted({type(t).__name__ for t in tests})}"
    )


def _one_of(name: str, in_tests, column):
    if in_tests is not None and column is not None and in_tests != column:
        raise ValueError(f"{name} is given both in the tests ({in_tests!r}) and as a column ({column!r})")
    return in_tests if in_tests is not None else column


def _parse(source, what: str) -> ast.Module:
    if not isinstance(source, str):
        raise TypeError(f"{what} must be a str of Python source, got {type(source).__name__}")
    try:
        return ast.parse(source)
    except SyntaxError as exc:
        raise ValueError(f"{what} is not valid Python: {exc}") from None


def _top_level_functions(tree: ast.Module) -> set[str]:
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}


def _checked_setup(setup) -> str:
    if setup is None:
        return ""
    _parse(setup, "setup")
    return setup


def _checked_entry_point(entry_point, required: bool) -> str | None:
    if entry_point is None and not required:
        return None
    if not isinstance(entry_point, str) or not entry_point.isidentifier():
        raise ValueError(
            f"entry_point must be the name of the function under test (HumanEval tests call "
            f"check(entry_point)), got {entry_point!r}"
        )
    return entry_point


def _check_spec(test, entry_point, setup) -> dict:
    tree = _parse(test, "the HumanEval test source")
    if "check" not in _top_level_functions(tree):
        raise ValueError("the HumanEval test source must define check(candidate)")
    spec = {
        "kind": "check",
        "test": test,
        "setup": _checked_setup(setup),
        "entry_point": _checked_entry_point(entry_point, required=True),
        "names": _names_read([tree]),
    }
    _check_names(spec, test, "check()")
    return spec


def _names_read(trees: list[ast.Module]) -> list[str]:
    """Every name the parsed sources read (a superset of their free names): what the judge may need to bind."""
    return sorted(
        {
            node.id
            for tree in trees
            for node in ast.walk(tree)
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)
        }
    )


def _check_names(spec: dict, source: str, what: str) -> None:
    """With an entry point the program supplies nothing else: every other global the tests read must exist."""
    defined = set(vars(builtins)) | JUDGE_MODULES | {spec["entry_point"]}
    top = symtable.symtable(source, "<tests>", "exec")
    for table in (symtable.symtable(spec["setup"], "<tests>", "exec"), top):
        defined |= {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    used, tables = set(), [top]
    while tables:
        table = tables.pop()
        used |= {s.get_name() for s in table.get_symbols() if s.is_referenced() and (table is top or s.is_global())}
        tables += table.get_children()
    missing = used - defined
    if missing:
        raise ValueError(
            f"{what} uses {sorted(missing)}, which neither the tests nor setup define; the program "
            f"supplies only the entry point {spec['entry_point']!r} (pass the source that defines them, "
            f"e.g. HumanEval's prompt, as setup)"
        )


def _test_count(spec: dict) -> int:
    if spec["kind"] == "check":
        return 1
    return len(spec["asserts"] if spec["kind"] == "asserts" else spec["cases"])


def _same_output(got: str, expected: str) -> bool:
    lines = lambda s: [line.rstrip() for line in s.rstrip().splitlines()]  # noqa: E731
    return lines(got) == lines(expected)


def _checked(result):
    """A sandbox that cannot start programs, or tests that cannot run, are setup problems, not a wrong answer."""
    if result.error is not None:
        raise RuntimeError(f"the code sandbox could not score the program: {result.error}")
    return result


def run_test(
    code: str, spec: dict, case, limits: SandboxLimits, require_isolation: bool = False
) -> tuple[int, SandboxResult]:
    """One sandboxed run of program `code` against `spec` (as normalize_tests makes it; `case`:
    one of its input/output pairs for "io", else None): `(tests passed, the run)`. Raises
    RuntimeError where the sandbox cannot start or the tests themselves cannot run."""
    if spec["kind"] == "io":
        test_input, expected = case
        result = _checked(run_python(code, stdin=test_input, limits=limits, require_isolation=require_isolation))
        return int(result.ok and _same_output(result.stdout, expected)), result
    result = _checked(run_judged(code, spec, limits=limits, require_isolation=require_isolation))
    return min(result.passed or 0, _test_count(spec)), result


def _run_job(job, limits: SandboxLimits, require_isolation: bool) -> int:
    """code_reward's one run of `job` = (program, spec, case): the number of tests it passed."""
    return run_test(*job, limits, require_isolation)[0]


def split_tests(spec: dict) -> list[tuple[dict, object]]:
    """Each test of `spec` as a run of its own: `(spec, case)` pairs for run_test, in the tests'
    order (an assert list one spec per statement, each input/output pair its case, HumanEval's
    check() as it is), so that a caller can tell which test failed first."""
    if spec["kind"] == "io":
        return [(spec, case) for case in spec["cases"]]
    if spec["kind"] == "asserts":
        return [({**spec, "asserts": [statement]}, None) for statement in spec["asserts"]]
    return [(spec, None)]


def code_reward(
    prompts: list[str],
    completions: list[str],
    tests: list | None = None,
    *,
    test_list: list | None = None,
    entry_point: list | None = None,
    setup: list | None = None,
    limits: SandboxLimits | None = None,
    max_workers: int | None = None,
    require_isolation: bool = False,
    **columns,
) -> list[float | None]:
    """Fraction of each completion's tests that its program passes, the program run in the sandbox.

    prompts, completions: N strings. The program is the last fenced Python block of the
        completion (or the whole completion).
    tests: N test specs (see the module docstring); None or empty scores None.
        `test_list` (MBPP's column name) is used when `tests` is not given.
    entry_point, setup: optional columns of N values (None where unused), as in the module docstring.
    limits: SandboxLimits for each run (default 4 s wall, 2 GiB for 8 processes, 1 MiB output).
    max_workers: parallel sandboxes (default: the CPU cores available to this process).
    require_isolation: raise RuntimeError rather than run without namespaces (SECURITY.md).
    Returns N floats in [0, 1] or None. Raises for malformed tests or a sandbox that cannot
    start, never because of what a program did. Pass the keyword options with functools.partial.
    Example:
        >>> code_reward(["add"], ["```python\\ndef add(a, b):\\n    return a + b\\n```"],
        ...             tests=[["assert add(1, 2) == 3", "assert add(0, 0) == 1"]])
        [0.5]
    """
    tests = tests if tests is not None else test_list
    if tests is None:
        raise ValueError("code_reward needs a tests column: tests=[N test specs] (or MBPP's test_list=[...])")
    optional = {name: column for name, column in (("entry_point", entry_point), ("setup", setup)) if column is not None}
    n = check_batch(prompts, completions, {"tests": tests, **optional, **columns})
    completions = completion_texts(completions)
    limits = limits or SandboxLimits()
    entry_points, setups = entry_point or [None] * n, setup or [None] * n
    specs, prepared = [], {}
    for i, t in enumerate(tests):
        # A group's samples share one tests object (the rollout repeats the row): parse it once.
        key = (id(t), entry_points[i], setups[i])
        if key not in prepared:
            try:
                prepared[key] = normalize_tests(t, entry_points[i], setups[i])
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"tests[{i}]: {exc}") from exc
        specs.append(prepared[key])
    jobs, owners = [], []
    for i, spec in enumerate(specs):
        if spec is None:
            continue
        code = extract_code(completions[i])
        cases = spec["cases"] if spec["kind"] == "io" else [None]
        jobs.extend((code, spec, case) for case in cases)
        owners.extend([i] * len(cases))
    workers = max(1, min(max_workers or len(os.sched_getaffinity(0)), len(jobs) or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        passed = list(pool.map(lambda job: _run_job(job, limits, require_isolation), jobs))
    totals = [0] * n
    for i, p in zip(owners, passed):
        totals[i] += p
    return [None if spec is None else totals[i] / _test_count(spec) for i, spec in enumerate(specs)]
