"""Trace records, ring buffer, summary and Chrome trace export."""

from __future__ import annotations

import json
import time

import attrs
import pytest
import trio

from ksana.events import Actor, EventLoop, Trace, TraceRecord, VirtualClock, WallClock, advance, handles


@attrs.frozen
class Step:
    seconds: float


@attrs.frozen
class Note:
    text: str


class Worker(Actor):
    name = "worker"

    @handles(Step)
    async def on_step(self, msg: Step) -> float:
        await advance(msg.seconds)
        return self.now()


class Scheduler(Actor):
    name = "scheduler"

    @handles(Note)
    async def on_note(self, msg: Note) -> None:
        await self.send(Step(0.25))


def run_virtual(fn):
    async def main():
        with trio.fail_after(86_400):
            return await fn()

    return trio.run(main, clock=VirtualClock.trio_clock())


def traced_loop(trace_capacity: int = 100_000) -> EventLoop:
    """Worker gets Step(1.0) and Step(2.0) back to back (the second queues 1 s), then a request Step(0.5),
    then the scheduler forwards a Note as Step(0.25), then a request Step(0.0) queues behind it."""

    async def main():
        loop = EventLoop(clock=VirtualClock(), trace_capacity=trace_capacity)
        loop.register(Worker())
        loop.register(Scheduler())
        async with loop.running():
            await loop.send(Step(1.0), sender="external")
            await loop.send(Step(2.0), sender="external")
            assert await loop.request(Step(0.5), sender="external") == 3.5
            await loop.request(Note("go"), sender="external")  # returns once the forwarded Step is queued
            assert await loop.request(Step(0.0), sender="external") == 3.75
        return loop

    return run_virtual(main)


def test_records_carry_types_actors_and_virtual_times():
    loop = traced_loop()
    got = [
        (r.message_type, r.sender, r.receiver, r.sent, r.started, r.finished, r.is_request)
        for r in loop.trace.records()
    ]
    assert got == [
        ("Step", "external", "worker", 0.0, 0.0, 1.0, False),
        ("Step", "external", "worker", 0.0, 1.0, 3.0, False),
        ("Step", "external", "worker", 0.0, 3.0, 3.5, True),
        ("Note", "external", "scheduler", 3.5, 3.5, 3.5, True),
        ("Step", "scheduler", "worker", 3.5, 3.5, 3.75, False),
        ("Step", "external", "worker", 3.5, 3.75, 3.75, True),
    ]
    assert loop.trace.records()[1].queue_s == 1.0 and loop.trace.records()[1].handling_s == 2.0


def test_summary_per_message_type():
    summary = traced_loop().trace.summary()
    assert set(summary) == {"Step", "Note"}
    step = summary["Step"]
    assert step["count"] == 5
    assert step["total_handling_s"] == pytest.approx(1.0 + 2.0 + 0.5 + 0.25)
    assert step["mean_queue_s"] == pytest.approx((0 + 1.0 + 3.0 + 0 + 0.25) / 5)
    assert step["max_queue_s"] == pytest.approx(3.0)
    assert summary["Note"]["count"] == 1 and summary["Note"]["total_handling_s"] == 0.0


def test_chrome_trace_structure_and_json_round_trip(tmp_path):
    loop = traced_loop()
    doc = loop.trace.to_chrome_trace()
    events = doc["traceEvents"]
    names = {e["args"]["name"]: e["tid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {"worker": 1, "scheduler": 2}
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == 6
    second = complete[1]
    assert second["name"] == "Step" and second["tid"] == names["worker"] and second["cat"] == "message"
    assert second["ts"] == 1_000_000.0 and second["dur"] == 2_000_000.0  # microseconds
    assert second["args"] == {
        "sender": "external",
        "receiver": "worker",
        "is_request": False,
        "queue_us": 1e6,
    }
    assert complete[2]["cat"] == "request"
    assert complete[3]["tid"] == names["scheduler"] and complete[4]["args"]["sender"] == "scheduler"
    begins = [e for e in events if e["ph"] == "b"]
    ends = {e["id"]: e for e in events if e["ph"] == "e"}
    assert len(begins) == len(ends) == 6
    queued = begins[1]
    assert queued["cat"] == "queue" and queued["ts"] == 0.0 and ends[queued["id"]]["ts"] == 1_000_000.0

    path = tmp_path / "trace.json"
    loop.trace.write_chrome_trace(path)
    assert json.loads(path.read_text()) == json.loads(json.dumps(doc))


def test_ring_buffer_keeps_the_newest_records():
    loop = traced_loop(trace_capacity=2)
    records = loop.trace.records()
    assert len(loop.trace) == 2
    assert [(r.receiver, r.started) for r in records] == [("worker", 3.5), ("worker", 3.75)]
    assert loop.trace.num_recorded == 6 and loop.trace.num_evicted == 4
    assert loop.trace.to_chrome_trace()["otherData"] == {"num_records": 2, "num_evicted": 4}


def test_capacity_zero_disables_tracing():
    loop = traced_loop(trace_capacity=0)
    assert not loop.trace.enabled
    assert loop.trace.records() == [] and loop.trace.summary() == {}
    assert [e["ph"] for e in loop.trace.to_chrome_trace()["traceEvents"]] == ["M"]
    with pytest.raises(ValueError):
        Trace(-1)


def test_trace_unit_add_and_clear():
    trace = Trace(3)
    for i in range(5):
        trace.add(TraceRecord("T", "s", "r", float(i), i + 0.5, i + 1.0, False))
    assert [r.sent for r in trace.records()] == [2.0, 3.0, 4.0]
    trace.clear()
    assert len(trace) == 0 and trace.num_recorded == 0


def test_wall_clock_loop_records_monotonic_times():
    async def main():
        loop = EventLoop()  # WallClock under trio's real clock
        assert isinstance(loop.clock, WallClock)
        loop.register(Worker())
        async with loop.running():
            before = time.monotonic()
            await loop.request(Step(0.0), sender="external")
            after = time.monotonic()
        (record,) = loop.trace.records()
        # Times on time.monotonic's scale, taken while the request was under way, in order.
        assert before <= record.sent <= record.started <= record.finished <= after

    trio.run(main)
