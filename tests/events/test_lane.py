"""The blocking lane: one thread for every call, in order, uncancellable once running, inline under a virtual clock."""

from __future__ import annotations

import hashlib
import threading
import weakref

import pytest
import trio
import trio.testing

from ksana.events.lane import BlockingLane


def test_every_call_runs_on_the_same_thread_across_trio_runs():
    lane = BlockingLane("test-lane")

    async def main():
        return [await lane.run(threading.current_thread) for _ in range(3)]

    try:
        first, second = trio.run(main), trio.run(main)
        threads = set(first + second)
        assert len(threads) == 1 and threading.main_thread() not in threads
        assert lane.thread in threads and lane.thread.name == "test-lane" and lane.thread.is_alive()
    finally:
        lane.close()


def test_results_and_exceptions_come_back_to_the_caller():
    lane = BlockingLane("test-lane")

    def fail():
        raise KeyError("missing")

    async def main():
        assert await lane.run(divmod, 17, 5) == (3, 2)
        with pytest.raises(KeyError, match="missing"):
            await lane.run(fail)
        return await lane.run(len, "still serving")  # a failed call leaves the thread working

    try:
        assert trio.run(main) == len("still serving")
    finally:
        lane.close()


def test_calls_from_concurrent_tasks_run_one_at_a_time_in_order():
    lane = BlockingLane("test-lane")
    active, most_active, order = [0], [0], []
    lock = threading.Lock()

    def work(i: int) -> int:
        with lock:
            active[0] += 1
            most_active[0] = max(most_active[0], active[0])
        digest = hashlib.sha256(bytes(1 << 20)).digest()  # hashes this large release the GIL: threads would overlap
        with lock:
            active[0] -= 1
            order.append(i)
        return digest

    async def main():
        async with trio.open_nursery() as nursery:
            for i in range(12):
                nursery.start_soon(lane.run, work, i)
                await trio.testing.wait_all_tasks_blocked()  # task i queued its call before task i + 1 starts

    try:
        trio.run(main)
    finally:
        lane.close()
    assert most_active[0] == 1 and order == list(range(12))


def test_a_cancelled_caller_still_waits_for_its_running_call():
    lane = BlockingLane("test-lane")
    started, proceed = threading.Event(), threading.Event()
    finished = []

    def slow():
        started.set()
        proceed.wait(timeout=30)
        finished.append(True)
        return "done"

    async def main():
        returned = []

        async def caller(scope_box):
            with trio.CancelScope() as scope:
                scope_box.append(scope)
                returned.append(await lane.run(slow))
                returned.append(list(finished))  # what the caller saw the moment run returned

        async with trio.open_nursery() as nursery:
            scopes = []
            nursery.start_soon(caller, scopes)
            await trio.to_thread.run_sync(started.wait)
            scopes[0].cancel()
            await trio.testing.wait_all_tasks_blocked()
            assert not returned  # cancelled, but still waiting for the call
            proceed.set()
        return returned

    try:
        assert trio.run(main) == ["done", [True]]
    finally:
        lane.close()


def test_close_ends_the_thread_and_a_later_call_starts_another():
    lane = BlockingLane("test-lane")

    async def main():
        return await lane.run(threading.current_thread)

    first = trio.run(main)
    lane.close()
    assert not first.is_alive() and lane.thread is None
    second = trio.run(main)
    lane.close()
    assert second is not first and not second.is_alive()
    lane.close()  # closing a closed lane does nothing


def test_a_lane_dropped_without_close_ends_its_thread_and_frees_its_last_call():
    """What an engine dropped without ``close()`` relies on: its lane's idle thread must not keep the lane, nor the
    work of the last call (a runner, a model), alive."""

    class Work:
        def __call__(self) -> int:
            return 7

    work = Work()
    last_call_work = weakref.ref(work)
    lane = BlockingLane("test-lane")
    assert trio.run(lane.run, work) == 7
    thread = lane.thread
    del lane, work
    thread.join(timeout=60)  # returns at once when the thread ends; the timeout only bounds a failure
    assert not thread.is_alive() and last_call_work() is None


def test_under_an_autojumping_mock_clock_calls_run_inline():
    lane = BlockingLane("test-lane")

    async def main():
        return await lane.run(threading.current_thread)

    clock = trio.testing.MockClock(autojump_threshold=0)
    assert trio.run(main, clock=clock) is threading.main_thread()
    assert lane.thread is None


def test_submitted_calls_run_in_order_and_one_left_behind_by_its_run_does_not_stop_the_lane():
    lane = BlockingLane("test-lane")
    gate, order = threading.Event(), []

    def blocked():
        gate.wait(30)
        order.append("left behind")

    async def submit_and_leave():
        first = lane.submit(order.append, "first")
        lane.submit(blocked)  # never awaited: its trio run ends while it waits on the gate
        assert await first.result() is None

    async def later_run():
        return await lane.run(len, "still serving")

    try:
        trio.run(submit_and_leave)
        gate.set()
        assert trio.run(later_run) == len("still serving")
        assert order == ["first", "left behind"]
    finally:
        lane.close()
