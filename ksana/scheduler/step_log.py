"""The step log: one JSON line per executed step, its shape and when it ran (``ksana serve --step-log FILE``).

A serving step does not cost what perf mode measures alone: HTTP, the streams' events and the load generator share
the cores, and a steady run of steps keeps the forward warm. The log is what the simulator's calibration fits the
served step costs from (``ksana simulate calibrate``), and what a person reads to see where a step's time went. Each line:

    {"step_id": 7, "rows": [[new_tokens, context_after_step], ...], "planned_at": t, "started_at": t,
     "finished_at": t, "result_at": t, "prepare_s": s, "forward_s": s, "sample_s": s,
     "arrivals": [[row_index, arrived_at], ...], "request_ids": [id, ...]}

Times are ``time.monotonic()`` seconds: when the scheduler sent the plan, when the worker's thread began and ended
the step, and when the scheduler had the result. ``arrivals`` names the rows whose request is scheduled for the
first time, with when the scheduler received it; ``request_ids`` names each row's request, so a request can be
followed from its arrival through the steps that compute its tokens. Its time in the engine up to each token is
then known, and what a client measures beyond that is its time outside the engine (HTTP, the client).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import IO

import attrs
import orjson

from ksana.messages import StepPlan, StepTimings


@attrs.frozen
class LoggedStep:
    step_id: int
    rows: tuple[tuple[int, int], ...]
    planned_at: float
    started_at: float
    finished_at: float
    result_at: float
    prepare_s: float
    forward_s: float
    sample_s: float
    arrivals: tuple[tuple[int, float], ...] = ()
    request_ids: tuple[str, ...] = ()

    @property
    def duration_s(self) -> float:
        return self.finished_at - self.started_at

    def to_json(self) -> dict:
        return {**attrs.asdict(self), "rows": [list(row) for row in self.rows],
                "arrivals": [list(arrival) for arrival in self.arrivals], "request_ids": list(self.request_ids)}

    @classmethod
    def from_json(cls, data: dict) -> LoggedStep:
        return cls(**{**data, "rows": tuple((int(q), int(c)) for q, c in data["rows"]),
                      "arrivals": tuple((int(i), float(t)) for i, t in data.get("arrivals", ())),
                      "request_ids": tuple(str(r) for r in data.get("request_ids", ()))})


class StepLog:
    """Writes a line when a step's result comes in; the plan's shape is kept from when it was sent."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file: IO[bytes] = self.path.open("wb", buffering=0)  # a line per step survives a killed server
        self._planned: dict[int, tuple[tuple[tuple[int, int], ...], float, tuple[tuple[int, float], ...],
                                       tuple[str, ...]]] = {}
        self._arrived: dict[str, float] = {}  # requests not yet in a plan

    def arrived(self, request_id: str) -> None:
        self._arrived[request_id] = time.monotonic()

    def discard(self, request_id: str) -> None:
        """A request that leaves before its first step (aborted)."""
        self._arrived.pop(request_id, None)

    def planned(self, plan: StepPlan) -> None:
        rows = tuple((row.num_new_tokens, row.seq_len) for row in plan.rows)
        arrivals = tuple((index, self._arrived.pop(row.request_id)) for index, row in enumerate(plan.rows)
                         if row.request_id in self._arrived)
        ids = tuple(row.request_id for row in plan.rows)
        self._planned[plan.step_id] = (rows, time.monotonic(), arrivals, ids)

    def finished(self, step_id: int, timings: StepTimings) -> None:
        rows, planned_at, arrivals, ids = self._planned.pop(step_id)
        step = LoggedStep(step_id, rows, planned_at, timings.started_at, timings.finished_at, time.monotonic(),
                          timings.prepare_s, timings.forward_s, timings.sample_s, arrivals, ids)
        self._file.write(orjson.dumps(step.to_json()) + b"\n")

    def close(self) -> None:
        self._file.close()


def read_step_log(path: str | Path) -> list[LoggedStep]:
    with open(path, "rb") as f:
        return [LoggedStep.from_json(orjson.loads(line)) for line in f if line.strip()]
