"""code_reward's test protocol: the program answers calls, a judge outside the sandbox decides.

Two processes take part (`_boot.py` starts both):
- the sandboxed child runs the trusted `setup`, then the program, then `serve`s the judge's
  requests on a pipe: what the names used by the tests are bound to, and calls of the
  program's functions with given arguments;
- the judge (the bootstrap, outside the sandbox) runs the tests themselves (`judge`), with
  Python's own semantics, in its own interpreter. A name the tests take from the program is
  a proxy there: calling it sends the arguments to the child and returns the child's result.
  Expected values, comparisons and `assert`s never enter the sandbox.
Only plain data crosses (`encode` / `decode`): None, bool, int, float, complex, str, bytes,
bytearray, list, tuple, dict, set and frozenset, as tagged JSON, never pickle. Whatever the
program does to its own interpreter, all the judge ever gets from it are such values, so
an object that claims to equal everything arrives as an error, not as a pass.
"""

import builtins
import json
import os
import select
import sys
import time

MAX_DEPTH = 100  # nesting of encoded values; deeper fails as not plain data
# Standard-library modules that tests use without importing them (MBPP's `math.isclose`,
# relying on the solution's `import math`): the judge imports its own copy. Any other
# module a test needs, the test or setup imports.
JUDGE_MODULES = frozenset(
    {
        "math",
        "cmath",
        "re",
        "string",
        "collections",
        "itertools",
        "functools",
        "operator",
        "heapq",
        "bisect",
        "fractions",
        "decimal",
        "statistics",
        "random",
        "copy",
        "datetime",
        "json",
        "array",
        "numbers",
        "typing",
    }
)
# Exceptions a call may raise in the judge: Exception's builtin subclasses, except those
# that end an iteration early (`all(map(f, cases))` would pass on an empty map).
PASSED_THROUGH = frozenset(
    name
    for name, value in vars(builtins).items()
    if isinstance(value, type)
    and issubclass(value, Exception)
    and not issubclass(value, (StopIteration, StopAsyncIteration))
)


class SolutionError(Exception):
    """A call of the program's function failed in a way with no builtin equivalent."""


class ChannelClosed(SolutionError):
    """The program stopped answering: it exited, was killed, ran out of time or broke the protocol."""


# ---------------------------------------------------------------- values


def encode(value, _depth: int = 0):
    """`value` as JSON-ready data; subclasses of the plain types travel as their base type.

    Raises TypeError for anything else (functions, generators, class instances, numpy
    arrays; numpy integers and floats are numbers).
    """
    if _depth > MAX_DEPTH:
        raise TypeError(f"values nested deeper than {MAX_DEPTH} are not plain data")
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, complex):
        return {"complex": [value.real, value.imag]}
    if isinstance(value, (bytes, bytearray)):
        return {"bytearray" if isinstance(value, bytearray) else "bytes": value.hex()}
    if isinstance(value, list):
        return [encode(v, _depth + 1) for v in value]
    for tag, kind in (("tuple", tuple), ("frozenset", frozenset), ("set", set)):
        if isinstance(value, kind):
            return {tag: [encode(v, _depth + 1) for v in value]}
    if isinstance(value, dict):
        return {"dict": [[encode(k, _depth + 1), encode(v, _depth + 1)] for k, v in value.items()]}
    if hasattr(type(value), "__index__"):
        return value.__index__()
    raise TypeError(f"{type(value).__name__} is not plain data")


def decode(data, _depth: int = 0):
    """The value `encode` made; ValueError for anything that is not such data."""
    if _depth > MAX_DEPTH:
        raise ValueError(f"values nested deeper than {MAX_DEPTH} are not plain data")
    if data is None or type(data) in (bool, int, float, str):
        return data
    if type(data) is list:
        return [decode(x, _depth + 1) for x in data]
    if type(data) is dict and len(data) == 1:
        ((tag, payload),) = data.items()
        if tag in ("bytes", "bytearray") and type(payload) is str:
            return (bytes if tag == "bytes" else bytearray).fromhex(payload)
        if type(payload) is list:
            if tag == "complex" and len(payload) == 2 and all(type(x) in (int, float) for x in payload):
                return complex(*payload)
            if tag == "dict" and all(type(p) is list and len(p) == 2 for p in payload):
                try:
                    return {decode(k, _depth + 1): decode(v, _depth + 1) for k, v in payload}
                except TypeError as exc:  # an unhashable key
                    raise ValueError(str(exc)) from exc
            kind = {"tuple": tuple, "set": set, "frozenset": frozenset}.get(tag)
            if kind is not None:
                try:
                    return kind(decode(x, _depth + 1) for x in payload)
                except TypeError as exc:
                    raise ValueError(str(exc)) from exc
    raise ValueError(f"not plain data: {str(data)[:100]}")


# ---------------------------------------------------------------- the child (inside the sandbox)


def serve(setup: str, program: str, requests_fd: int, replies_fd: int) -> None:
    """Runs `setup` and the program in one namespace, then answers requests until the judge hangs up.

    A program that raises or exits while loading answers nothing, and so passes no test.
    """
    module = type(builtins)("solution")
    sys.modules["solution"] = module  # pickle (multiprocessing) finds the program's functions
    namespace = module.__dict__
    exec(compile(setup, "<setup>", "exec"), namespace)
    exec(compile(program, "solution.py", "exec"), namespace)
    with open(requests_fd, "rb") as requests, open(replies_fd, "wb") as replies:
        for line in requests:
            request = json.loads(line)
            if request["op"] == "names":
                reply = {"names": {name: _describe(namespace[name]) for name in request["names"] if name in namespace}}
            else:
                reply = _call(namespace.get(request["name"]), request["args"], request["kwargs"])
            replies.write(json.dumps(reply).encode() + b"\n")
            replies.flush()


def _describe(value):
    if callable(value):
        return "callable"
    try:
        return {"value": encode(value)}
    except TypeError as exc:
        return {"unsupported": str(exc)}


def _call(function, args, kwargs) -> dict:
    try:
        result = function(*[decode(a) for a in args], **{k: decode(v) for k, v in kwargs})
    except Exception as exc:  # noqa: BLE001 - the judge decides what a raised exception means
        return {"raise": type(exc).__name__}
    try:
        data = encode(result)
        json.dumps(data)  # ints too long for JSON fail here, not while replying
    except (TypeError, ValueError) as exc:
        return {"unsupported": str(exc)}
    return {"return": data}


# ---------------------------------------------------------------- the judge (outside the sandbox)


class Channel:
    """Requests to the child and its one-line replies, each bounded in size and by the run's deadline."""

    def __init__(self, requests_fd: int, replies_fd: int, deadline: float, max_reply_bytes: int):
        self.requests_fd, self.replies_fd = requests_fd, replies_fd
        self.deadline, self.max_reply_bytes = deadline, max_reply_bytes
        self.closed = False
        self.buffer = b""
        for fd in (requests_fd, replies_fd):
            os.set_blocking(fd, False)

    def request(self, message: dict) -> dict:
        if self.closed:
            raise ChannelClosed("the program stopped answering")
        try:
            self._send(json.dumps(message).encode() + b"\n")
            reply = json.loads(self._receive_line())
            if type(reply) is not dict:
                raise ValueError("a reply must be a JSON object")
            return reply
        except (OSError, ValueError, RecursionError) as exc:
            self.closed = True  # out of step with the child: nothing it says later can be trusted
            raise ChannelClosed(f"the program stopped answering: {exc}") from None

    def _wait(self, fd: int, event: int) -> None:
        remaining = self.deadline - time.monotonic()
        poller = select.poll()
        poller.register(fd, event)
        if remaining <= 0 or not poller.poll(remaining * 1000):
            raise OSError("the run's time is up")

    def _send(self, data: bytes) -> None:
        while data:
            self._wait(self.requests_fd, select.POLLOUT)
            data = data[os.write(self.requests_fd, data) :]

    def _receive_line(self) -> bytes:
        while b"\n" not in self.buffer:
            if len(self.buffer) > self.max_reply_bytes:
                raise ValueError(f"a reply is longer than {self.max_reply_bytes} bytes")
            self._wait(self.replies_fd, select.POLLIN)
            try:
                chunk = os.read(self.replies_fd, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                raise OSError("the program closed the channel")
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line


class ProgramFunction:
    """Stands in the judge for a function of the program: a call is a round trip to the child."""

    def __init__(self, channel: Channel, name: str):
        self.channel, self.name = channel, name

    def __call__(self, *args, **kwargs):
        reply = self.channel.request(
            {
                "op": "call",
                "name": self.name,
                "args": [encode(a) for a in args],
                "kwargs": [[k, encode(v)] for k, v in kwargs.items()],
            }
        )
        if "return" in reply:
            try:
                return decode(reply["return"])
            except ValueError as exc:
                raise SolutionError(f"{self.name} returned {exc}") from None
        name = reply.get("raise")
        if name in PASSED_THROUGH:
            raise getattr(builtins, name)(f"raised by {self.name}")
        raise SolutionError(f"{self.name}: {name or reply.get('unsupported')}")


def judge(tests: dict, channel: Channel) -> int:
    """Runs the tests outside the sandbox; returns how many passed.

    tests: {"kind": "asserts", "asserts": [statement, ...]} (each statement one test) or
        {"kind": "check", "test": source defining check(candidate)} (one test: check(entry point)),
        with "setup" (trusted source run first, here and before the program), "entry_point"
        (a name always taken from the program; None for asserts without one) and "names"
        (every name the tests read, which code.py found).
    Names resolve to: builtins; what setup and the test source define (trusted); the
    standard-library modules of JUDGE_MODULES; the entry point, from the program; without an
    entry point, any other name, from the program (a function becomes a ProgramFunction, a
    plain value is copied). code.py has checked that with an entry point nothing else is missing.
    """
    namespace = {"__name__": "__test__", "__builtins__": builtins}
    exec(compile(tests["setup"], "<setup>", "exec", dont_inherit=True, optimize=0), namespace)
    if tests["kind"] == "check":
        exec(compile(tests["test"], "<test>", "exec", dont_inherit=True, optimize=0), namespace)
    free = set(tests["names"]) - set(namespace) - set(vars(builtins))
    for name in free & JUDGE_MODULES:
        namespace[name] = __import__(name)
    wanted = {tests["entry_point"]} if tests["entry_point"] is not None else free - JUDGE_MODULES
    try:
        # Asked even when no test needs a name: the answer says the program loaded at all.
        described = channel.request({"op": "names", "names": sorted(wanted)})["names"]
    except (ChannelClosed, KeyError):
        return 0
    if type(described) is not dict:
        return 0
    namespace.pop(tests["entry_point"], None)  # setup's stub of it (HumanEval's prompt) is not the program's
    for name in wanted & set(described):
        description = described[name]
        if description == "callable":
            namespace[name] = ProgramFunction(channel, name)
        elif type(description) is dict and "value" in description:
            try:
                namespace[name] = decode(description["value"])
            except ValueError:
                pass
    if tests["kind"] == "check":
        candidate = namespace.get(tests["entry_point"])
        if not isinstance(candidate, ProgramFunction):
            return 0
        try:
            namespace["check"](candidate)
        except Exception:  # noqa: BLE001 - any failure of the test is a fail
            return 0
        return 1
    passed = 0
    for i, statement in enumerate(tests["asserts"]):
        try:
            exec(compile(statement, f"<test {i}>", "exec", dont_inherit=True, optimize=0), namespace)
            passed += 1
        except Exception:  # noqa: BLE001
            pass
    return passed
