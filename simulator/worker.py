"""The simulated worker: takes the real worker's place, answers each ``ExecuteStep`` after the step's fitted
latency on the virtual clock, and samples tokens that never end a request early.

Steps run one after another, as on the real worker's lane. A step starts when the worker is free and the engine
has finished its own work around the plan (the fitted engine time, counted from the plan's arrival): without
async scheduling the plan arrives after the previous step's update, so a step costs engine + worker time; with it
the next plan arrives while a step runs, and the engine's time hides behind the forward unless it is longer.
"""

from __future__ import annotations

import zlib

import attrs
import trio

from ksana.events import Actor, handles
from ksana.messages import ExecuteStep, SampledToken, StepPlan, StepResult, StepTimings
from ksana.simulator.features import StepShape
from ksana.simulator.fit import LatencyFit


@attrs.define
class StepRecord:
    """One simulated step, for the report and the Chrome trace."""

    step_id: int
    started_at: float
    finished_at: float
    num_rows: int
    num_tokens: int
    num_prefill_rows: int


class SimulatedWorker(Actor):
    name = "worker"

    def __init__(self, fit: LatencyFit, vocab_size: int, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.fit = fit
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.steps: list[StepRecord] = []
        self.busy_s = 0.0
        self._free_at = 0.0
        self._plans_tx: trio.MemorySendChannel[tuple[StepPlan, float]] | None = None

    async def on_start(self) -> None:
        self._plans_tx, plans_rx = trio.open_memory_channel[tuple[StepPlan, float]](float("inf"))
        self.start_soon(self._run_steps, plans_rx)

    @handles(ExecuteStep)
    async def on_execute(self, msg: ExecuteStep) -> None:
        self._plans_tx.send_nowait((msg.plan, trio.current_time()))

    async def _run_steps(self, plans_rx: trio.MemoryReceiveChannel[tuple[StepPlan, float]]) -> None:
        async for plan, arrived_at in plans_rx:
            shape = StepShape.from_plan(plan)
            start = max(trio.current_time(), arrived_at + self.fit.engine_s(shape))
            duration = self.fit.worker_s(shape)
            await trio.sleep_until(start + duration)
            self.busy_s += duration
            self.steps.append(StepRecord(plan.step_id, start, start + duration, len(plan.rows), shape.num_tokens,
                                         sum(1 for q, _ in shape.rows if q > 1)))
            sampled = {row.request_id: SampledToken(self._token(row.request_id, row.seq_len), 0.0)
                       for row in plan.rows if row.do_sample}
            timings = StepTimings(forward_s=duration, started_at=start, finished_at=start + duration)
            await self.send(StepResult(step_id=plan.step_id, sampled=sampled, timings=timings))

    def _token(self, request_id: str, position: int) -> int:
        """A token that depends on the request and position (so outputs differ, as a model's would) and is never
        an end-of-sequence id (output lengths come from the workload)."""
        token = zlib.crc32(f"{request_id}:{position}".encode()) % self.vocab_size
        while token in self.eos_token_ids:
            token = (token + 1) % self.vocab_size
        return token
