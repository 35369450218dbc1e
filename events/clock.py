"""Clocks: the loop reads time only through a `Clock`, so the simulator can swap wall time for virtual time.

The clock must agree with trio's own clock, because actors wait with `trio.sleep` (see `advance`):
`WallClock` with trio's default clock (serving), `VirtualClock` with `trio.testing.MockClock` (simulation, tests).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

import trio
import trio.testing

T = TypeVar("T")


@runtime_checkable
class Clock(Protocol):
    def now(self) -> float:
        """Current time in seconds (monotonic; only differences are meaningful)."""
        ...


async def advance(dt: float) -> None:
    """Sleep on the loop's clock for `dt` seconds.

    Under `VirtualClock` (trio MockClock with autojump) this costs no real time: virtual time jumps as soon as
    every task is blocked, which is how the simulated worker "spends" a fitted forward-pass latency.
    """
    await trio.sleep(dt)


async def run_blocking(fn: Callable[..., T], *args: Any) -> T:
    """Run blocking work (a forward pass, a file load) off the event loop, in a worker thread.

    Under an autojumping `MockClock` it runs inline instead: autojump sees the task waiting for the thread as
    idle and would jump virtual time to the next deadline (a timeout, a sleeping actor) while the thread works.
    Inline, the work takes zero virtual time, which is what a virtual-clock run wants.
    """
    if blocking_runs_inline():
        await trio.lowlevel.checkpoint()
        return fn(*args)
    return await trio.to_thread.run_sync(fn, *args)


def blocking_runs_inline() -> bool:
    """True under an autojumping ``MockClock``, where blocking work must run inline (see ``run_blocking``)."""
    clock = trio.lowlevel.current_clock()
    return isinstance(clock, trio.testing.MockClock) and clock.autojump_threshold != math.inf


class WallClock:
    """Monotonic wall time (`time.monotonic`); trio's default clock has a random offset, so it is not used."""

    def now(self) -> float:
        return time.monotonic()

    async def advance(self, dt: float) -> None:
        """Sleep on the loop's clock (real time here)."""
        await trio.sleep(dt)

    def __repr__(self) -> str:
        return "WallClock()"


class VirtualClock:
    """Trio's current time: virtual under `MockClock`, so `await trio.sleep(dt)` advances it for free.

    `now()` works only inside `trio.run`. Run with ``trio.run(main, clock=VirtualClock.trio_clock())``.
    """

    def now(self) -> float:
        return trio.current_time()

    async def advance(self, dt: float) -> None:
        """Sleep on the loop's clock (virtual time here)."""
        await trio.sleep(dt)

    @staticmethod
    def trio_clock(autojump_threshold: float = 0.0) -> trio.testing.MockClock:
        """A MockClock that jumps to the next deadline as soon as all tasks block (time 0.0 at start)."""
        return trio.testing.MockClock(autojump_threshold=autojump_threshold)

    def __repr__(self) -> str:
        return "VirtualClock()"
