"""A lane: one long-lived thread that runs an actor's blocking calls in order, off the trio loop.

Why not ``trio.to_thread``: its cache hands each call to whichever thread is idle, and every thread that runs a torch
parallel region keeps an OpenMP pool of its own. Forward passes that move between threads multiply the pools until
libgomp throttles them (see ``ksana/worker/fresh_thread.py``); one thread keeps one pool for the engine's life. The
hand-off is also lighter than the thread cache's: a queue and one ``run_sync_soon`` a call.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import trio

from .clock import blocking_runs_inline

T = TypeVar("T")


class BlockingLane:
    """Runs ``await lane.run(fn, *args)`` (or ``lane.submit``) on its own thread, one call at a time, in the order
    they come.

    The thread starts with the first call and ends with ``close()``, or once the lane itself is dropped: the thread
    holds the queue, not the lane, so an engine dropped without ``close()`` frees its model and ends its thread
    (with the thread's OpenMP pool). It is a daemon, so a lane never left open keeps the process alive. As
    ``trio.to_thread.run_sync``, a call cannot be cancelled once it runs: ``run``'s caller waits for it, so the work
    never outlives the caller unobserved; ``submit``'s caller owns that wait (the worker actor drains its queued
    steps when the loop stops). Under an autojumping ``MockClock`` the call runs inline, as ``events.run_blocking``
    does, so that virtual time does not jump while the thread works.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        weakref.finalize(self, self._jobs.put, None)  # a dropped lane ends its thread (see the class docstring)

    @property
    def thread(self) -> threading.Thread | None:
        """The lane's thread once a call started it (and until ``close``)."""
        return self._thread

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await self.submit(fn, *args).result()

    def submit(self, fn: Callable[..., T], *args: Any) -> LaneCall[T]:
        """Queue the call and return at once; ``await call.result()`` for its value. Calls run in submission order,
        so a caller can queue the next piece of work before the current one ends and the thread never waits for
        the loop between them. Under an autojumping ``MockClock`` the call runs here, inline."""
        call: LaneCall[T] = LaneCall()
        if blocking_runs_inline():
            call.run(fn, args)
            call.done.set()
            return call
        token = trio.lowlevel.current_trio_token()

        def job() -> None:
            call.run(fn, args)
            try:
                token.run_sync_soon(call.done.set)
            except trio.RunFinishedError:  # its trio run ended without waiting: nobody is left to tell
                pass

        self._start()
        self._jobs.put(job)
        return call

    def close(self) -> None:
        """Let the thread finish the calls queued so far, then end; a later ``run`` starts a new thread."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._jobs.put(None)
            thread.join()

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=_serve, args=(self._jobs,), name=self.name, daemon=True)
                self._thread.start()


def _serve(jobs: queue.SimpleQueue[Callable[[], None] | None]) -> None:
    """A lane's thread: the queued calls until a None (``close()``, or the lane dropped)."""
    while (job := jobs.get()) is not None:
        job()
        job = None  # an idle thread must not keep its last call's work (a model, a KV cache) alive


class LaneCall(Generic[T]):
    """One call queued on a lane: its outcome, set on the lane's thread, read on the loop."""

    def __init__(self) -> None:
        self.done = trio.Event()
        self._returned: list[T] = []
        self._raised: list[BaseException] = []

    def run(self, fn: Callable[..., T], args: tuple) -> None:
        try:
            self._returned.append(fn(*args))
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller's task
            self._raised.append(error)

    async def result(self) -> T:
        """The call's value (or its exception). Shielded, as a thread cannot be cancelled: a cancelled caller still
        waits for the call to end, so the work never outlives it unobserved."""
        with trio.CancelScope(shield=True):
            await self.done.wait()  # a checkpoint even when set, as a thread hand-off is
        if self._raised:
            raise self._raised[0]
        return self._returned[0]
