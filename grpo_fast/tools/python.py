"""The built-in `python` tool: run a program the model wrote, in the project's code sandbox.

Each call is a fresh interpreter (`grpo_fast.sandbox.run_python`: separate process,
namespaces where the kernel allows, resource limits; SECURITY.md says what it guarantees), so
calls are stateless: nothing one defines is there in the next. The limits are tighter than the
code reward's (`LIMITS`): a tool call is one step of a rollout that many others wait on.

The answer is what a person at a terminal would see: stdout, then stderr (the traceback of an
exception), then a note when the program timed out, was killed or exited non-zero; each cut in
the middle to a few KB. It never raises: a failure of the sandbox itself is reported as text.
The sandbox has no pool of its own; `max_concurrency` (one sandbox per CPU core, like
code_reward's default) makes run_tool_calls hold the process to that many at once.
"""

import os
import re

from grpo_fast.sandbox import SandboxLimits, run_python

# A few seconds, a small memory (numpy and sympy still import: 128 MiB of address space per
# process without a cgroup), a few processes, and output kept small: the model reads at most
# OUTPUT_CHARS of it, and the rest would only be cut.
LIMITS = SandboxLimits(wall_time_s=5.0, memory_bytes=512 << 20, max_processes=4, output_bytes=16 << 10)
# Longest stdout and stderr shown to the model, each, in characters (cut in the middle).
OUTPUT_CHARS = 4_000
# The sandbox's bootstrap runs the program from its own frame; the model should see the
# traceback of its program as `python -c` would print it, without that frame or the host's paths.
_BOOT_FRAME = re.compile(r'^  File "[^"\n]*_boot\.py", line \d+, in \w+\n(?:    .*\n)?', re.MULTILINE)


def python(code: str) -> str:
    """Run a Python program in a fresh interpreter and return what it prints; variables do not persist between calls.

    Args:
        code: The complete Python program to run; print() every value you want to see.

    Returns:
        The program's stdout, then its stderr (the traceback of an uncaught exception), and a note on a timeout.
    """
    if not isinstance(code, str):
        return f"error: the argument code must be a string of Python source, got {type(code).__name__}"
    try:
        result = run_python(code, limits=LIMITS)
    except Exception as exc:  # the sandbox could not start at all: the model is told, the rollout goes on
        return f"error: the sandbox could not run the program ({type(exc).__name__}: {exc})"
    parts = []
    if result.stdout:
        parts.append(_cut(result.stdout))
    stderr = _BOOT_FRAME.sub("", result.stderr)
    if stderr:
        parts.append("stderr:\n" + _cut(stderr))
    if result.error is not None:
        parts.append(f"error: the sandbox could not run the program ({result.error})")
    elif result.timed_out:
        parts.append(f"error: timed out after {LIMITS.wall_time_s:g}s (the program was stopped)")
    elif result.signal is not None:
        parts.append(f"error: the program was killed by signal {result.signal} (out of memory or a limit)")
    elif result.exit_code not in (0, None) and not stderr:
        parts.append(f"error: the program exited with status {result.exit_code}")
    return "\n".join(part.rstrip("\n") for part in parts) if parts else "(no output)"


def _cut(text: str, limit: int = OUTPUT_CHARS) -> str:
    if len(text) <= limit:
        return text
    head = limit // 2
    tail = limit - head
    return f"{text[:head]}\n[... {len(text) - limit} characters cut ...]\n{text[-tail:]}"


# One sandbox per CPU core available to this process (read by resolve_tools; see the module docstring).
python.max_concurrency = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
