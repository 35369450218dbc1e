"""The event loop's thread below the forward pass's threads in the OS scheduler's eyes.

On a CPU whose cores the forward pass's threads fill (the 2-core machines: two OpenMP threads), each slice of CPU the
server's loop takes (HTTP, every stream's chunks, the scheduler) preempts one forward thread, and the other then
waits for it at the next barrier. A higher nice value for the loop alone lets the kernel run it when a forward thread
waits instead; async scheduling leaves the loop a whole step to plan the next one, so it still keeps up.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ksana.events import BlockingLane

MAX_NICE = 19
DEFAULT_LOOP_NICE = 10  # measured: see ``ServeOptions.loop_nice``


def parse_loop_nice(text: str) -> int:
    """argparse's ``type`` for ``--loop-nice``: an int in 0-19, or a message that names the flag."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_NICE:
        raise argparse.ArgumentTypeError(f"takes 0-{MAX_NICE} (0 leaves the loop's priority), not {text!r}")
    return value


def _started() -> None:
    """Nothing: the call only makes the lane start its thread."""


async def lower_loop_priority(forward_lane: BlockingLane, nice: int) -> bool:
    """Raise the calling thread's nice value by ``nice``; True if it changed.

    Linux threads inherit their creator's nice value, so the forward lane's thread (which then starts its OpenMP
    team) is started first and keeps its own. Only Linux sets one thread's priority: elsewhere ``PRIO_PROCESS``
    names the whole process, so it is left alone.
    """
    if nice <= 0 or sys.platform != "linux":
        return False
    await forward_lane.run(_started)
    thread_id = threading.get_native_id()
    before = os.getpriority(os.PRIO_PROCESS, thread_id)
    os.setpriority(os.PRIO_PROCESS, thread_id, min(MAX_NICE, before + nice))
    return os.getpriority(os.PRIO_PROCESS, thread_id) != before
