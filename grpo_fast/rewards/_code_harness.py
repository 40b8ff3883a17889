"""Test harness, run inside the sandbox as the program of `run_python` with args MODE NONCE (see code.py).

MODE "assert": runs solution.py, then each statement of tests.json in the same namespace,
and writes "NONCE <passed>" as the last stdout line. A solution that raises or exits
(even sys.exit(0)) before the tests run passes none of them. Only the first process
reports, so a forked child cannot add a second count.
MODE "io": runs solution.py as __main__ with the test input on stdin; the caller compares
stdout with the expected output.
"""

import json
import os
import sys
import traceback


def main() -> None:
    mode, nonce = sys.argv[1], sys.argv[2]
    del sys.argv[1:]
    with open("solution.py") as f:
        source = f.read()
    if mode == "io":
        exec(compile(source, "solution.py", "exec"), {"__name__": "__main__"})
        return
    with open("tests.json") as f:
        tests = json.load(f)
    report_fd, report_pid = os.dup(1), os.getpid()
    namespace = {"__name__": "solution"}
    passed = 0
    try:
        exec(compile(source, "solution.py", "exec"), namespace)
    except BaseException:  # noqa: BLE001 - SystemExit and KeyboardInterrupt fail it too
        traceback.print_exc()
    else:
        for test in tests:
            try:
                exec(compile(test, "test", "exec"), namespace)
                passed += 1
            except BaseException:  # noqa: BLE001
                traceback.print_exc()
    if os.getpid() == report_pid:
        try:
            sys.stdout.flush()
        finally:
            os.write(report_fd, f"\n{nonce} {passed}\n".encode())
            os._exit(0)  # skip atexit hooks and non-daemon threads the solution left behind


main()
