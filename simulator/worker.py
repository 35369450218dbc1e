"""The simulated worker: takes the real worker's place, answers each ``ExecuteStep`` after the step's fitted
latency on the virtual clock, and samples tokens that never end a request early.

Steps run one after another, as on the real worker's lane. A step starts when the worker is free and the engine
has finished its own work around the plan (the fitted engine time, counted from the plan's arrival): without
async scheduling (or with it and no request waiting) the plan arrives after the previous step's update, so a step
costs engine + worker time; with it and a queue the next plan arrives while a step runs, and the engine's time
hides behind the forward unless it is longer.

Speculative decoding (``SpecAcceptance``): the worker drafts for every request it samples (as an MTP module
would), and accepts a verify row's draft at position ``j`` with the given probability, in order, until one is
rejected; the scheduler budgets, verifies and rolls back exactly as it does in serving, and the fit prices a
verify row as the multi-token row it is.
"""

from __future__ import annotations

import hashlib
import zlib

import attrs
import trio

from ksana.events import Actor, handles
from ksana.messages import ExecuteStep, SampledToken, ScheduledRow, StepPlan, StepResult, StepTimings
from ksana.simulator.features import StepShape
from ksana.simulator.fit import LatencyFit
from ksana.simulator.served_speed import ServedSpeed


@attrs.frozen
class SpecAcceptance:
    """Drafts per step and the probability that the draft at each position is accepted (as ``/metrics``'
    ``spec_draft_position_acceptance_rate`` or ``bench/speculative.py`` report them)."""

    num_drafts: int
    by_position: tuple[float, ...]

    def __attrs_post_init__(self) -> None:
        if len(self.by_position) < self.num_drafts:
            raise ValueError(f"{self.num_drafts} drafts per step need an acceptance rate for each of "
                             f"{self.num_drafts} positions, got {len(self.by_position)}")
        if not all(0.0 <= rate <= 1.0 for rate in self.by_position):
            raise ValueError(f"acceptance rates must lie in [0, 1], got {self.by_position}")


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

    def __init__(self, fit: LatencyFit, vocab_size: int, eos_token_ids: tuple[int, ...] = (),
                 spec: SpecAcceptance | None = None, speed: ServedSpeed | None = None) -> None:
        """``speed``: a served run's speed over time, scaling each step's price by the factor at its start (a
        diagnostic of ``ksana simulate validate``: the simulation as if it knew the machine's slow stretches)."""
        self.fit = fit
        self.spec = spec
        self.speed = speed
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.steps: list[StepRecord] = []
        self.busy_s = 0.0
        self._origin = 0.0
        self._plans_tx: trio.MemorySendChannel[tuple[StepPlan, float]] | None = None

    async def on_start(self) -> None:
        self._origin = trio.current_time()
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
            if self.speed is not None:
                duration *= self.speed.factor(shape, start - self._origin)
            await trio.sleep_until(start + duration)
            self.busy_s += duration
            self.steps.append(StepRecord(plan.step_id, start, start + duration, len(plan.rows), shape.num_tokens,
                                         shape.num_prefill_rows))
            sampled = {row.request_id: self._sample(row) for row in plan.rows if row.do_sample}
            timings = StepTimings(forward_s=duration, started_at=start, finished_at=start + duration)
            await self.send(StepResult(step_id=plan.step_id, sampled=sampled, timings=timings))

    def _sample(self, row: ScheduledRow) -> SampledToken:
        """The row's token; a verify row's drafts accepted by chance, each after the one before it; and the next
        step's drafts."""
        if self.spec is None:
            return SampledToken(self._token(row.request_id, row.seq_len), 0.0)
        first = row.seq_len - row.num_draft_tokens  # the position of the row's first new token
        drafts = row.draft_token_ids if row.num_draft_tokens else ()
        num_accepted = 0
        while num_accepted < len(drafts) and self._accepts(row.request_id, first + num_accepted, num_accepted):
            num_accepted += 1
        rejected = drafts[num_accepted] if num_accepted < len(drafts) else None
        emitted = [*drafts[:num_accepted], self._token(row.request_id, first + num_accepted, avoid=rejected)]
        last = first + len(emitted)
        next_drafts = tuple(self._token(row.request_id, last + j) for j in range(self.spec.num_drafts))
        tokens = [SampledToken(token, 0.0) for token in emitted]
        return attrs.evolve(tokens[0], following=tuple(tokens[1:]), draft_token_ids=next_drafts)

    def _accepts(self, request_id: str, position: int, draft_index: int) -> bool:
        """A fixed coin per request and position: blake2b's bits are uniform where crc32's, over strings that
        differ in a digit, are not."""
        digest = hashlib.blake2b(f"accept:{request_id}:{position}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") / 2**64 < self.spec.by_position[draft_index]

    def _token(self, request_id: str, position: int, avoid: int | None = None) -> int:
        """A token that depends on the request and position (so outputs differ, as a model's would) and is never
        an end-of-sequence id (output lengths come from the workload)."""
        token = zlib.crc32(f"{request_id}:{position}".encode()) % self.vocab_size
        while token in self.eos_token_ids or token == avoid:  # ``avoid``: a rejected draft, which it is not
            token = (token + 1) % self.vocab_size
        return token
