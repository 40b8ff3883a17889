"""Functions run at once, whatever they do: the tools' calls and the environments' steps.

Sync functions run in daemon threads, async ones on one shared event loop; each has a deadline
past which it is given up (a thread abandoned, a coroutine cancelled). Nothing a function does
(raise, hang, exit) raises here: each job comes back as an :class:`Outcome`. Only the standard
library is imported.
"""

import asyncio
import queue
import threading
import time
from typing import NamedTuple

# Async tools share one event loop, in a daemon thread started on first use: a tool that keeps
# loop-bound state (an HTTP session, say) works across batches, and no batch waits for a loop.
_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()
# Calls of a tool with `max_concurrency` hold one of its slots while they really run, across
# every concurrent run_tool_calls of this process (a timed-out call keeps its slot until its
# thread ends: the slots bound the work actually running, e.g. sandboxes per CPU core).
_slots: dict[object, threading.BoundedSemaphore] = {}
_slots_lock = threading.Lock()
# How often a batch looks again for a slot that another batch holds.
_SLOT_POLL_S = 0.01
# How long past its timeout an async call may take before it is reported timed out without its
# own answer: only reached when something blocks the shared loop itself.
_ASYNC_GRACE_S = 1.0


class Outcome(NamedTuple):
    """What one job of :func:`run_concurrently` came to."""

    value: object  # what the function returned (None when it failed)
    error: str | None  # how it failed, as "raised ValueError: ...", "timed out after 10s", ...; None: it returned
    seconds: float  # its wall time (the timeout for one that timed out; the wait for one never started)


def run_concurrently(jobs: list, *, timeout_s: float, max_workers: int | None = None) -> list[Outcome]:
    """Calls each job's ``tool.function(**arguments)`` at once, sync ones in daemon threads, async
    ones on a shared event loop; one :class:`Outcome` per job, in order. Never raises for what a
    function does (it raises, hangs, exits): the tools' calls and the environments' steps.

    jobs:        (Tool, arguments) pairs; a Tool's ``max_concurrency`` holds its running calls
                 across the process, as :func:`run_tool_calls` says.
    timeout_s:   seconds a job may run from its start (a sync one is abandoned past it, an async
                 one cancelled).
    max_workers: jobs running at once; default every job, up to 32.
    """
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    if max_workers is not None and (
        isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1
    ):
        raise ValueError(f"max_workers must be a positive int or None, got {max_workers!r}")
    outcomes: list = [None] * len(jobs)
    if jobs:
        _run_jobs(list(enumerate(jobs)), outcomes, float(timeout_s), max_workers or min(32, len(jobs)))
    return outcomes


def _run_jobs(jobs: list, outcomes: list, timeout_s: float, workers: int) -> None:
    """Start the jobs ``(index, (tool, arguments))`` as worker and tool slots allow; collect
    their outcomes; give up on jobs past their deadline."""
    done: queue.Queue = queue.Queue()
    pending = list(jobs)
    running: dict[int, float] = {}  # index -> deadline
    started_at: dict[int, float] = {}
    # When this batch last got a slot of each limited tool: a call that waits for one through
    # 2 * timeout_s without any freeing up fails, since then the slots are held by hung calls
    # (abandoned threads keep theirs), and it must not wait forever.
    last_slot: dict[str, float] = {}
    batch_start = time.monotonic()
    while pending or running:
        blocked = False
        for job in list(pending):
            if len(running) >= workers:
                break
            index, (tool, arguments) = job
            slot = _slot_of(tool)
            if slot is not None and not slot.acquire(blocking=False):
                waited = time.monotonic() - last_slot.get(tool.name, batch_start)
                if waited > 2 * timeout_s:
                    pending.remove(job)
                    message = (
                        f"timed out after {waited:.3g}s waiting for a free slot: its "
                        f"{tool.max_concurrency} concurrent calls are all still running"
                    )
                    outcomes[index] = Outcome(None, message, waited)
                else:
                    blocked = True  # later jobs of other tools may still start
                continue
            pending.remove(job)
            now = time.monotonic()
            started_at[index] = now
            if slot is not None:
                last_slot[tool.name] = now
            if tool.is_async:
                running[index] = now + timeout_s + _ASYNC_GRACE_S
                _start_async(index, tool, arguments, timeout_s, slot, done)
            else:
                running[index] = now + timeout_s
                _start_thread(index, tool, arguments, slot, done)
        if not running:
            if pending:  # every pending call waits for a slot that another batch or a hung call holds
                time.sleep(_SLOT_POLL_S)
            continue
        wait = max(0.0, min(running.values()) - time.monotonic())
        if blocked:
            wait = min(wait, _SLOT_POLL_S)
        try:
            index, outcome = done.get(timeout=wait)
        except queue.Empty:
            pass
        else:
            if index in running:  # else: an abandoned call that answered after all; dropped
                del running[index]
                outcomes[index] = outcome
        now = time.monotonic()
        for index, deadline in list(running.items()):
            if now >= deadline:
                del running[index]
                outcomes[index] = Outcome(None, f"timed out after {timeout_s:g}s", now - started_at[index])


def _slot_of(tool) -> threading.BoundedSemaphore | None:
    limit = getattr(tool, "max_concurrency", None)
    if limit is None:
        return None
    with _slots_lock:
        slot = _slots.get(tool.function)
        if slot is None:
            slot = _slots[tool.function] = threading.BoundedSemaphore(limit)
        return slot


def _start_thread(index: int, tool, arguments: dict, slot, done: queue.Queue) -> None:
    def work():
        start = time.monotonic()
        try:
            value, error = tool.function(**arguments), None
        except BaseException as exc:  # SystemExit too: a tool's sys.exit() must not end the thread silently
            value, error = None, f"raised {type(exc).__name__}: {exc}"
        finally:
            if slot is not None:
                slot.release()  # before the answer, so the scheduler finds the slot free when it wakes
        done.put((index, Outcome(value, error, time.monotonic() - start)))

    # A daemon thread, not a pool's: a hung tool must never keep the interpreter from exiting
    # (concurrent.futures joins its workers at exit).
    threading.Thread(target=work, name=f"tool-{tool.name}-{index}", daemon=True).start()


def _start_async(index: int, tool, arguments: dict, timeout_s: float, slot, done: queue.Queue) -> None:
    async def work():
        start = time.monotonic()
        try:
            task = asyncio.ensure_future(tool.function(**arguments))
            finished, _ = await asyncio.wait({task}, timeout=timeout_s)
            if not finished:
                task.cancel()
                value, error = None, f"timed out after {timeout_s:g}s"
            elif task.exception() is not None:
                exc = task.exception()
                value, error = None, f"raised {type(exc).__name__}: {exc}"
            else:
                value, error = task.result(), None
        except BaseException as exc:  # the coroutine function itself raised
            value, error = None, f"raised {type(exc).__name__}: {exc}"
        finally:
            if slot is not None:
                slot.release()
        done.put((index, Outcome(value, error, time.monotonic() - start)))

    asyncio.run_coroutine_threadsafe(work(), _event_loop())


def _event_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _loop_lock:
        if _loop is None or _loop.is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="tool-event-loop", daemon=True).start()
            _loop = loop
        return _loop
