"""Blocking library calls that Ctrl-C interrupts.

CPython runs a signal's Python handler (``KeyboardInterrupt`` for SIGINT) only on the main
thread and only between bytecodes: while the main thread is inside a C call (a ``wait`` for a
signal that never comes, a barrier with a rank that never arrives), Ctrl-C does nothing until
the call returns at its timeout. So a blocking call made on the main thread runs on a worker
thread instead, and the main thread waits for it on a lock, which a signal does interrupt. On
an interrupt the caller's ``on_interrupt`` runs (its text becomes a note of the exception) (the communicator aborts, which releases the
call) and the exception propagates at once; the worker finishes the abandoned call in the
background.

The cost is one hand-off to a kept worker thread and back per blocking call made on the main
thread (bench/RESULTS.md, "Python: the cost of an interruptible call"); other threads call
directly. ``MSCCLPP_PY_INTERRUPTIBLE=0`` or :func:`set_interruptible` turns it off.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, Optional

_enabled = os.environ.get("MSCCLPP_PY_INTERRUPTIBLE", "1") != "0"


def set_interruptible(on: bool) -> None:
    """Whether blocking calls made on the main thread (waits, flushes, barriers, setup,
    communicator creation) run on a worker thread so that Ctrl-C interrupts them (default:
    on, unless ``MSCCLPP_PY_INTERRUPTIBLE=0``). Off, each such call is one C call fewer hops
    but Ctrl-C waits for it to return (at the latest at its timeout)."""
    global _enabled
    _enabled = bool(on)


def interruptible() -> bool:
    """Whether :func:`set_interruptible` is on."""
    return _enabled


class _Job:
    __slots__ = ("fn", "done", "result", "error", "abandoned", "late")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.result: Any = None
        self.error: Optional[BaseException] = None
        self.abandoned = False
        # For an abandoned job: what to do with a result that arrives after all (a handle the
        # caller will never see must still be freed).
        self.late: Optional[Callable[[Any], None]] = None


_lock = threading.Lock()
# Workers without a job: each blocks in its own lock until handed one. A worker whose call
# was abandoned rejoins once that call returns, so that an interrupted call never holds up
# the next one.
_idle: list["_Worker"] = []


def _forget_workers() -> None:
    # A fork child has only the thread that forked: the parent's workers are not there.
    global _lock
    _lock = threading.Lock()
    _idle.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_workers)


class _Worker:
    def __init__(self) -> None:
        self._job: Optional[_Job] = None
        # Released by `submit`, acquired by the worker: one job at a time.
        self._go = threading.Lock()
        self._go.acquire()
        threading.Thread(target=self._loop, name="mscclpp_rs call", daemon=True).start()

    def submit(self, job: _Job) -> None:
        self._job = job
        self._go.release()

    def _loop(self) -> None:
        # Ends with the process (daemon): a worker is kept for the next call.
        while True:
            self._go.acquire()
            job = self._job
            assert job is not None
            try:
                job.result = job.fn()
            except BaseException as e:  # handed to the caller, re-raised there
                job.error = e
            self._job = None
            with _lock:
                late = job.abandoned
                if not late:
                    job.done.set()  # pairs with the caller's wait in `call`
                _idle.append(self)
            if late and job.error is None and job.late is not None:
                try:
                    job.late(job.result)
                except Exception:  # nobody to report it to: the caller has gone
                    pass
            # The job's closure holds the communicator: an idle worker must not keep it alive
            # (a dropped communicator is destroyed at once, by reference counting).
            del job


def call(
    fn: Callable[[], Any],
    on_interrupt: Callable[[], Optional[str]],
    late: Optional[Callable[[Any], None]] = None,
) -> Any:
    """``fn()``; on the main thread (when enabled) run by a worker thread while this thread
    waits in a lock that signals interrupt. If the wait is interrupted (``KeyboardInterrupt``,
    or any exception a signal handler raises), ``on_interrupt()`` runs, the call is abandoned
    (``late(result)`` runs on the worker if it succeeds after all) and the exception
    propagates, with the text ``on_interrupt`` returns as a note."""
    if not _enabled or threading.current_thread() is not threading.main_thread():
        return fn()
    job = _Job(fn)
    with _lock:
        w = _idle.pop() if _idle else None
    if w is None:
        w = _Worker()
    w.submit(job)
    try:
        job.done.wait()  # set by the worker when fn returned; Ctrl-C interrupts it
    except BaseException as e:
        with _lock:
            finished = job.done.is_set()
            job.abandoned = not finished
            job.late = late
        # Even when the call ended as the signal came, its caller never sees the result (a
        # wait's signal is consumed, say): the interrupt ends the communicator either way.
        if finished and job.error is None and late is not None:
            late(job.result)
        note = on_interrupt()
        if note and hasattr(e, "add_note"):  # Python 3.11+
            e.add_note(note)
        raise
    err, job.error = job.error, None
    if err is not None:
        # Not kept in this frame's locals past the raise: the traceback holds this frame, and
        # a frame that held the exception would make a cycle that only a garbage collection
        # frees (with every object the call's closure held: a buffer the user let go of).
        try:
            raise err
        finally:
            err = None
    return job.result
