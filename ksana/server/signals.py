"""Graceful stop on SIGINT/SIGTERM for the server and the router: the first signal starts the shutdown, a second
one stops at once."""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable

import trio

logger = logging.getLogger(__name__)


async def watch_signals(stop: trio.Event, cancel_scope: trio.CancelScope, on_first: Callable[[str], None],
                        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """``on_first(signal name)`` then ``stop.set()`` on the first signal; ``cancel_scope.cancel()`` on another."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        task_status.started()
        async for signum in signals:
            name = signal.Signals(signum).name
            if stop.is_set():
                logger.warning("%s again: stopping now", name)
                cancel_scope.cancel()
                return
            on_first(name)
            stop.set()
