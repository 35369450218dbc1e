"""The event loop's thread runs at a lower priority than the forward pass's threads (``ksana.server.priority``).

Linux, as the project's machines: ``/proc`` gives each thread's nice value.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import trio

from ksana.events import BlockingLane
from ksana.server.priority import DEFAULT_LOOP_NICE, lower_loop_priority, parse_loop_nice


def thread_nice(pid: int, thread_id: int) -> int:
    """A thread's nice value from ``/proc`` (field 19 of its stat line)."""
    stat = Path(f"/proc/{pid}/task/{thread_id}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[16])


def test_the_loop_thread_is_niced_and_the_forward_lanes_thread_keeps_its_priority():
    lane = BlockingLane("test-forward")
    seen: dict[str, int] = {}

    def loop_thread() -> None:  # a thread of its own: a nice value cannot be taken back without privileges
        seen["before"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        seen["changed"] = trio.run(lower_loop_priority, lane, 7)
        seen["loop"] = thread_nice(os.getpid(), threading.get_native_id())
        seen["lane"] = thread_nice(os.getpid(), lane.thread.native_id)

    runner = threading.Thread(target=loop_thread)
    runner.start()
    runner.join()
    lane.close()
    assert seen["changed"] is True
    assert seen["loop"] == min(19, seen["before"] + 7)
    assert seen["lane"] == seen["before"]  # the lane's thread started before the change, so it kept its priority


def test_nice_zero_changes_nothing_and_starts_no_thread():
    lane = BlockingLane("test-forward")
    assert trio.run(lower_loop_priority, lane, 0) is False
    assert lane.thread is None


def test_ksana_serve_runs_its_loop_thread_at_the_default_nice(server):
    pid = server.proc.pid  # trio runs in the process's main thread; it is niced before the server listens
    assert thread_nice(pid, pid) == DEFAULT_LOOP_NICE


@pytest.mark.parametrize("value", ["20", "-1", "high"])
def test_a_loop_nice_outside_0_to_19_is_refused(value):
    with pytest.raises(argparse.ArgumentTypeError, match=f"takes 0-19 .*not '{value}'"):
        parse_loop_nice(value)


def test_a_loop_nice_of_0_to_19_is_taken():
    assert [parse_loop_nice(text) for text in ("0", "7", "19")] == [0, 7, 19]


def test_a_bad_loop_nice_is_a_cli_error_that_names_the_flag():
    done = subprocess.run([sys.executable, "-m", "ksana.cli", "serve", "--model", "demo", "--loop-nice", "20"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--loop-nice" in done.stderr and "takes 0-19" in done.stderr
    assert "Traceback" not in done.stderr
