"""The scheduler actor: turns arrivals and step results into the next step's plan.

A step is planned when the worker can take one and there is work: the plan's blocks are requested from the cache
manager in one exchange (skipped when nothing there would change: no new block, nothing to release, no prefix
cache), the plan goes to the worker, and the worker's ``StepResult`` triggers the update, the next plan, and then
the outputs to the I/O actor.

With ``async_scheduling`` (the default) two steps can be in flight: step N+1 is planned as soon as step N is sent,
with N's sampled tokens as placeholders the worker fills in, so the worker goes from one forward pass straight into
the next and the scheduler, the messages and the I/O run beside it. It plans ahead only while requests wait,
though: a request that arrives during step N joins the first plan made after it, so with N+1 already planned it
would wait a whole step more for its first token. With nothing waiting, step N+1 is planned when N's result comes
in, and takes whatever arrived meanwhile; with a queue, an arrival waits behind it anyway and planning ahead keeps
the worker busy. Every plan is ordered after the steps before it on
the worker's one thread, which is what makes this safe: blocks freed or reused by a later plan are written by
the earlier step first. The pipeline falls back to one step in flight where a plan would need a preemption (only a
step's end frees blocks) and while a step loads remote KV (its result decides the next plan).

On a decode node (prefill/decode disaggregation) ``KVArrived`` hands a request its prompt's K/V and first token,
and a timer ends the requests whose K/V does not come in time.
"""

from __future__ import annotations

import collections
import logging

import trio

from ksana.events import Actor, handles
from ksana.messages import (
    AbortRequest,
    AddRequest,
    AddRequests,
    AllocateStepBlocks,
    ExecuteStep,
    FreeRequestBlocks,
    KVArrived,
    RequestDelta,
    StepPlan,
    StepResult,
    TokensOut,
)
from ksana.scheduler.batch_scheduler import BatchScheduler, SchedulerOutput
from ksana.scheduler.step_log import StepLog

logger = logging.getLogger(__name__)


class SchedulerActor(Actor):
    name = "scheduler"

    def __init__(self, scheduler: BatchScheduler, step_log: StepLog | None = None) -> None:
        self.scheduler = scheduler
        self.step_log = step_log
        self.max_steps_in_flight = 2 if scheduler.setting.plans_ahead else 1
        self._in_flight: collections.deque[SchedulerOutput] = collections.deque()
        self._next_step_id = 0
        self._pending_release: list[str] = []

    def _now(self) -> float:
        return self.loop.clock.now()

    def _tokens_out(self, deltas: tuple[RequestDelta, ...]) -> TokensOut:
        return TokensOut(deltas, time=self._now(), num_running=len(self.scheduler.running),
                         num_waiting=len(self.scheduler.waiting))

    async def on_start(self) -> None:
        if self.scheduler.awaits_kv:  # a decode node: its requests wait for their K/V, and may wait too long
            self.start_soon(self._expire_kv_waits)

    async def _expire_kv_waits(self) -> None:
        """Every second: end the requests whose K/V is overdue (``BatchScheduler.expire_kv_waits``)."""
        while True:
            await trio.sleep(1.0)
            deltas = self.scheduler.expire_kv_waits(self._now())
            if deltas:
                await self.send(self._tokens_out(tuple(deltas)))

    @handles(KVArrived)
    async def on_kv_arrived(self, msg: KVArrived) -> None:
        delta = self.scheduler.kv_arrived(msg, self._now())
        if delta is not None:
            await self.send(self._tokens_out((delta,)))
            await self._maybe_start_step()

    @handles(AddRequest)
    async def on_add(self, msg: AddRequest) -> None:
        await self._admit((msg.request,))

    @handles(AddRequests)
    async def on_add_many(self, msg: AddRequests) -> None:
        """Requests that arrive together are all queued before the next plan, so they can share one step."""
        await self._admit(msg.requests)

    async def _admit(self, requests) -> None:
        rejections = []
        for request in requests:
            if request.arrival_time == 0.0:
                request.arrival_time = self._now()
            rejection = self.scheduler.add_request(request)
            if rejection is not None:
                rejections.append(rejection)
            elif self.step_log is not None:
                self.step_log.arrived(request.request_id)
        if rejections:
            await self.send(self._tokens_out(tuple(rejections)))
        await self._maybe_start_step()

    @handles(AbortRequest)
    async def on_abort(self, msg: AbortRequest) -> None:
        """The blocks are freed at once: a later plan that reuses them runs after the steps in flight."""
        request = self.scheduler.abort_request(msg.request_id)
        if request is None:
            return
        if self.step_log is not None:
            self.step_log.discard(msg.request_id)
        logger.info("request %s aborted (%s)", msg.request_id, msg.reason)
        await self.send(FreeRequestBlocks((msg.request_id,)))
        delta = RequestDelta(request_id=msg.request_id, finish_reason=msg.reason,
                             num_prompt_tokens=request.num_prompt_tokens)
        await self.send(self._tokens_out((delta,)))

    @handles(StepResult)
    async def on_step_result(self, msg: StepResult) -> None:
        """Update, start the next step, then send this step's tokens: the I/O side's work (detokenization, client
        writes) then runs beside the next forward pass instead of before it. The finished requests' blocks are
        freed by the next step's block exchange (its ``release``), ahead of its demands, or at once when no plan
        follows."""
        assert self._in_flight and msg.step_id == self._next_step_id - len(self._in_flight), "step result out of order"
        out = self._in_flight.popleft()
        if self.step_log is not None:
            self.step_log.finished(msg.step_id, msg.timings)
        deltas, finished = self.scheduler.update(out, msg.sampled, msg.prompt_logprobs)
        if msg.remote_loaded:
            self.scheduler.note_remote_loaded(msg.remote_loaded)
        self._pending_release.extend(finished)
        tokens_out = self._tokens_out(tuple(deltas)) if deltas else None  # the queue sizes as of this step
        await self._maybe_start_step()
        if tokens_out is not None:
            await self.send(tokens_out)

    def _can_plan(self) -> bool:
        in_flight = self._in_flight
        if len(in_flight) >= self.max_steps_in_flight or not self.scheduler.has_unfinished:
            return False
        if in_flight and not self.scheduler.waiting:
            return False  # plan once this step ends, with whatever arrives while it runs
        return not any(out.remote_loads for out in in_flight)  # the load's result decides the request's next plan

    async def _maybe_start_step(self) -> None:
        while self._can_plan():
            out = self.scheduler.schedule(self._now(), allow_preempt=not self._in_flight)
            if out.rejected:
                await self.send(self._tokens_out(tuple(out.rejected)))
            release = tuple(self._pending_release) + tuple(r.request_id for r in out.preempted)
            self._pending_release.clear()
            if not out.scheduled:
                if release:
                    await self.send(FreeRequestBlocks(release))
                return
            if release or self.scheduler.needs_block_exchange(out):
                num_preempted = len(out.preempted)
                reply = await self.request(AllocateStepBlocks(self.scheduler.block_demands(out), release=release))
                self.scheduler.apply_blocks(out, reply)
                # Requests preempted on a refusal still hold blocks in the manager: release them next time.
                self._pending_release.extend(r.request_id for r in out.preempted[num_preempted:])
                if not out.scheduled and not out.remote_loads:
                    continue
            has_placeholders = any(s.request.num_pending_tokens for s in out.scheduled)
            self.scheduler.kv_transfers(out)
            plan = StepPlan(step_id=self._next_step_id, rows=self.scheduler.build_rows(out),
                            remote_loads=out.remote_loads, remote_saves=out.remote_saves,
                            kv_installs=out.kv_installs, kv_sends=out.kv_sends, has_placeholders=has_placeholders)
            self.scheduler.commit(out)
            self._next_step_id += 1
            self._in_flight.append(out)
            if self.step_log is not None:
                self.step_log.planned(plan)
            await self.send(ExecuteStep(plan))
        if self._pending_release:  # no plan to carry them: free them now (a step in flight is ordered before reuse)
            release = tuple(self._pending_release)
            self._pending_release.clear()
            await self.send(FreeRequestBlocks(release))
