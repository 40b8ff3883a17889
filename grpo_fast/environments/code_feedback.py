"""code_feedback: the model writes a program, the sandbox runs the row's tests, the model reads the
first failing test and revises.

An episode (one per sample; ``max_turns`` of the run bounds its attempts):

    reset(row)   the row's prompt; its tests read as code_reward reads them (a ``tests`` column,
                 else MBPP's ``test_list``; ``entry_point`` and ``setup`` columns), checked now
    step(turn)   the turn's program (its last ```python block, else the whole text) runs against
                 the tests one at a time, in order, each in its own sandbox (code_reward's
                 run_test: the judge outside the sandbox decides, so a program cannot forge a
                 pass), stopping at the first that fails:
                   all pass -> done, reward 1 - what earlier steps gave
                   a fail   -> a user message naming that test (its statement, or the input, the
                               expected and the actual output), whether it ran out of time, and
                               the tail of the program's error output; reward 0 - what earlier
                               steps gave; the episode goes on

The episode's reward (the sum of its steps') is the **last attempt's pass**, 1 or 0: each step
gives its attempt's score minus the sum so far, since the environment never knows which attempt
the turn loop will score last (``max_turns``, or a token budget that runs out). As the first pass
ends the episode, that is 0 for every failed attempt and 1 for the passing one. An attempt is a
pass only when every test passes (code_reward's fraction is 1).

The feedback quotes the failing test: with tests the prompt does not show (HumanEval's), it shows
them one by one; MBPP's prompt already lists its asserts.

Options (the factory makes an episode with no arguments: bind them with ``functools.partial``, or
subclass for ``--environment package.module:Class``):

    limits             SandboxLimits of each run (default code_reward's: 4 s wall, 2 GiB for 8
                       processes, 1 MiB of output); a step takes at most tests x wall_time_s,
                       which environment_timeout_s must leave room for
    require_isolation  refuse to run without the sandbox's namespaces (SECURITY.md)
    max_detail_chars   longest test, output or error text quoted in the feedback (cut beyond)
"""

import os
import threading

import grpo_fast.sandbox
from grpo_fast.environments.protocol import Environment, EnvStep, prompt_messages
from grpo_fast.rewards.code import extract_code, normalize_tests, run_test, split_tests
from grpo_fast.sandbox import SandboxLimits, SandboxResult

# Sandboxes running at once across this process's episodes: one per CPU core, as the python tool
# allows, so that a batch's steps do not share cores until correct programs run out of wall time.
_SANDBOX_SLOTS = threading.BoundedSemaphore(len(os.sched_getaffinity(0)))
# The sandbox's own frames, left out of the tracebacks the model reads.
_SANDBOX_DIR = os.path.dirname(os.path.abspath(grpo_fast.sandbox.__file__))


class CodeFeedback(Environment):
    """One coding episode: attempts scored by the row's tests in the sandbox, the first failing
    test's message after each failed one (the module docstring has the protocol).

    Attributes read by reward functions (``environments=``): ``attempts`` (programs judged so
    far) and ``score`` (the last attempt's: 1.0 pass, 0.0 fail; 0.0 before any).

    Example:
        >>> env = CodeFeedback()
        >>> env.reset({"prompt": "Write add(a, b).", "tests": ["assert add(1, 2) == 3"]})
        [{'role': 'user', 'content': 'Write add(a, b).'}]
        >>> env.step({"role": "assistant", "content": "```python\\ndef add(a, b):\\n    return a + b\\n```"})
        EnvStep(observations=[], done=True, reward=1.0)
    """

    def __init__(
        self, limits: SandboxLimits | None = None, *, require_isolation: bool = False, max_detail_chars: int = 400
    ):
        if limits is not None and not isinstance(limits, SandboxLimits):
            raise TypeError(f"limits must be a SandboxLimits or None, got {type(limits).__name__}")
        if isinstance(max_detail_chars, bool) or not isinstance(max_detail_chars, int) or max_detail_chars < 20:
            raise ValueError(f"max_detail_chars must be an int >= 20, got {max_detail_chars!r}")
        self.limits = limits or SandboxLimits()
        self.require_isolation = require_isolation
        self.max_detail_chars = max_detail_chars
        self.tests: list | None = None  # (spec, case) of each test, in order (split_tests); set by reset
        self.attempts, self.score = 0, 0.0

    def reset(self, row: dict) -> list:
        tests = row.get("tests")
        spec = normalize_tests(
            tests if tests is not None else row.get("test_list"), row.get("entry_point"), row.get("setup")
        )
        if spec is None:
            raise ValueError(
                f"code_feedback needs tests in each row (a tests column, or MBPP's test_list); this row has "
                f"columns {sorted(row)}"
            )
        self.tests = split_tests(spec)
        return prompt_messages(row)

    def step(self, message: dict) -> EnvStep:
        if self.tests is None:
            raise RuntimeError("CodeFeedback.step before reset: the episode has no tests yet")
        code = extract_code(message["content"])
        failed = None  # (spec, case, run) of the first failing test
        for spec, case in self.tests:
            with _SANDBOX_SLOTS:
                passed, run = run_test(code, spec, case, self.limits, self.require_isolation)
            if not passed:
                failed = (spec, case, run)
                break
        score = 0.0 if failed else 1.0
        reward, self.score = score - self.score, score
        self.attempts += 1
        if failed is None:
            return EnvStep([], True, reward)
        return EnvStep([{"role": "user", "content": self._feedback(*failed)}], False, reward)

    def _feedback(self, spec: dict, case, run: SandboxResult) -> str:
        """What the model reads after a failed attempt: the test, how the run ended, its errors."""
        cut = self.max_detail_chars
        if spec["kind"] == "io":
            lines = [
                "Your program failed a test. Its input:",
                _head(case[0].rstrip(), cut),
                "Expected output:",
                _head(case[1].rstrip(), cut),
                "Your program's output:",
                _head(run.stdout.rstrip(), cut) or "(nothing)",
            ]
        elif spec["kind"] == "asserts":
            lines = ["Your program failed this test:", _head(spec["asserts"][0], cut)]
        else:
            lines = [f"Your program failed the tests' check({spec['entry_point']})."]
        if run.timed_out:
            lines.append(f"It was stopped at the time limit ({self.limits.wall_time_s:g} s).")
        errors = "\n".join(line for line in run.stderr.strip().splitlines() if _SANDBOX_DIR not in line)
        if errors:
            lines += ["Its error output ends with:", _tail(errors, cut)]
        lines.append("Fix the program and answer with the whole corrected program.")
        return "\n".join(lines)


def _head(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _tail(text: str, limit: int) -> str:
    return text if len(text) <= limit else "..." + text[-(limit - 3) :]
