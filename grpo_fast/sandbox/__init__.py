"""Run an untrusted Python program in a separate, limited, isolated process.

Two users: ``code_reward`` (``grpo_fast.rewards.code``: the program in the sandbox, its tests
outside) and the ``python`` tool (``grpo_fast.tools.python``: the program's output back to the
model). SECURITY.md states the threat model and what each isolation mode guarantees.

    run_python(program, files=, stdin=, args=, limits=, require_isolation=) -> SandboxResult
    run_judged(program, tests, limits=, require_isolation=) -> SandboxResult (``passed`` set)
    SandboxLimits   wall and CPU time, memory, processes, output, files, scratch size
    SandboxResult   stdout, stderr, exit code or signal, timed_out, isolation, error, passed
    JUDGE_MODULES   standard-library modules the judge gives tests without an import

The modules, from the caller down:
    runner.py     the caller's side: limits, result, one bootstrap per run, the fallback's warning
    _boot.py      the bootstrap process: the protocol, the order of the set-up, fork, deadline,
                  judge, reap, report
    _confine.py   the mechanisms: namespaces, the read-only root, privileges, resource limits,
                  the fallback's seccomp filter and Landlock rules
    _judge.py     judged runs: the program serves calls, the tests run outside and count passes
The underscored modules run in the bootstrap's interpreter (``python -I -S``), imported from
this folder by name before anything else is importable: the standard library only, and
nothing from grpo_fast.

May import: the standard library only.
"""

from grpo_fast.sandbox._judge import JUDGE_MODULES
from grpo_fast.sandbox.runner import SandboxLimits, SandboxResult, run_judged, run_python

__all__ = ["run_python", "run_judged", "SandboxLimits", "SandboxResult", "JUDGE_MODULES"]
