"""The message trace: one record per handled message, in a bounded ring buffer, exportable to Chrome's format.

The engine's per-step overhead outside the forward pass is read from here (`summary`), and a run can be
inspected visually in Perfetto / chrome://tracing (`write_chrome_trace`).
"""

from __future__ import annotations

import collections
import os
from typing import Any

import attrs
import orjson


@attrs.frozen(slots=True)
class TraceRecord:
    """One delivered message. Times are clock seconds; `error` is set when the handler raised."""

    message_type: str
    sender: str
    receiver: str
    sent: float
    started: float
    finished: float
    is_request: bool
    error: str | None = None

    @property
    def queue_s(self) -> float:
        """Time spent in the mailbox (including time the sender was blocked by backpressure)."""
        return self.started - self.sent

    @property
    def handling_s(self) -> float:
        return self.finished - self.started


def _capacity_ok(instance: Any, attribute: Any, value: int) -> None:
    if value < 0:
        raise ValueError(f"trace capacity must be >= 0, got {value}")


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


@attrs.define
class Trace:
    """Bounded ring buffer of `TraceRecord`s; the oldest records are evicted first. Capacity 0 disables it."""

    capacity: int = attrs.field(default=100_000, validator=_capacity_ok)
    num_recorded: int = attrs.field(default=0, init=False)
    _records: collections.deque[TraceRecord] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._records = collections.deque(maxlen=self.capacity)

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    @property
    def num_evicted(self) -> int:
        return self.num_recorded - len(self._records)

    def add(self, record: TraceRecord) -> None:
        if self.capacity:
            self._records.append(record)
            self.num_recorded += 1

    def records(self) -> list[TraceRecord]:
        return list(self._records)

    def clear(self) -> None:
        self._records.clear()
        self.num_recorded = 0

    def __len__(self) -> int:
        return len(self._records)

    def summary(self) -> dict[str, dict[str, float]]:
        """Per message type over the records held: count, total/mean handling time, total/mean/max queueing."""
        acc: dict[str, list[float]] = {}
        for r in self._records:
            a = acc.get(r.message_type)
            if a is None:
                a = acc[r.message_type] = [0, 0.0, 0.0, 0.0]
            queue_s = r.started - r.sent
            a[0] += 1
            a[1] += r.finished - r.started
            a[2] += queue_s
            a[3] = max(a[3], queue_s)
        return {
            name: {
                "count": count,
                "total_handling_s": handling,
                "mean_handling_s": handling / count,
                "total_queue_s": queue,
                "mean_queue_s": queue / count,
                "max_queue_s": max_queue,
            }
            for name, (count, handling, queue, max_queue) in acc.items()
        }

    def to_chrome_trace(self, process_name: str = "ksana") -> dict[str, Any]:
        """Chrome trace-event JSON object.

        Each handled message is a complete ("X") event on its receiver's thread (one `tid` per actor, named by
        `thread_name` metadata), with sender, queueing delay and request flag in `args`. The time a message
        waited in the mailbox is also an async span ("b"/"e", category "queue") from send to start, since
        queued messages overlap and cannot share the receiver's thread track.
        """
        pid = 1
        tids: dict[str, int] = {}
        events: list[dict[str, Any]] = []
        for seq, r in enumerate(self._records):
            tid = tids.get(r.receiver)
            if tid is None:
                tid = tids[r.receiver] = len(tids) + 1
            args: dict[str, Any] = {
                "sender": r.sender,
                "receiver": r.receiver,
                "is_request": r.is_request,
                "queue_us": _us(r.started - r.sent),
            }
            if r.error is not None:
                args["error"] = r.error
            events.append(
                {
                    "name": r.message_type,
                    "cat": "request" if r.is_request else "message",
                    "ph": "X",
                    "ts": _us(r.started),
                    "dur": _us(r.finished - r.started),
                    "pid": pid,
                    "tid": tid,
                    "args": args,
                }
            )
            queued = {"name": f"{r.message_type} queued", "cat": "queue", "id": seq, "pid": pid, "tid": tid}
            events.append({**queued, "ph": "b", "ts": _us(r.sent), "args": {"sender": r.sender}})
            events.append({**queued, "ph": "e", "ts": _us(r.started)})
        metadata: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": process_name}}
        ]
        for name, tid in tids.items():
            metadata.append(
                {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
            )
            metadata.append(
                {"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}}
            )
        return {
            "traceEvents": metadata + events,
            "displayTimeUnit": "ms",
            "otherData": {"num_records": len(self._records), "num_evicted": self.num_evicted},
        }

    def write_chrome_trace(self, path: str | os.PathLike[str]) -> None:
        with open(path, "wb") as f:
            f.write(orjson.dumps(self.to_chrome_trace()))
