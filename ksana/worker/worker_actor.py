"""The worker actor: owns the model runner; forward passes run on a lane (one thread) so the loop keeps routing."""

from __future__ import annotations

import contextlib

import trio

from ksana.events import Actor, BlockingLane, handles
from ksana.events.lane import LaneCall
from ksana.messages import (
    ExecuteStep,
    KVArrived,
    PromptLogprobs,
    SampledToken,
    StepPlan,
    StepResult,
    StepTimings,
)
from ksana.worker.model_runner import ModelRunner

StepOutcome = tuple[dict[str, SampledToken], StepTimings, dict[str, int], dict[str, PromptLogprobs]]


class WorkerActor(Actor):
    """``lane``: the thread the forward passes run on. The engine passes its own, which outlives each loop, so
    every forward of its life runs on one thread; without one the actor opens a lane and closes it on stop.

    A step goes onto the lane the moment its ``ExecuteStep`` arrives, even while the step before it runs: with async
    scheduling the lane then starts the next forward pass as soon as one ends. A background task sends the
    results back in step order.
    """

    name = "worker"

    def __init__(self, runner: ModelRunner, lane: BlockingLane | None = None) -> None:
        self.runner = runner
        self._owns_lane = lane is None
        self.lane = lane if lane is not None else BlockingLane("ksana-worker")
        self._steps_tx: trio.MemorySendChannel[tuple[int, LaneCall[StepOutcome]]] | None = None

    async def on_start(self) -> None:
        self._steps_tx, steps_rx = trio.open_memory_channel[tuple[int, LaneCall[StepOutcome]]](float("inf"))
        self.start_soon(self._send_results, steps_rx)
        connector = getattr(self.runner, "kv_connector", None)
        if connector is not None and connector.role == "decode":
            arrivals_tx, arrivals_rx = trio.open_memory_channel[KVArrived](float("inf"))
            token = trio.lowlevel.current_trio_token()

            def on_arrival(msg: KVArrived) -> None:  # on the connector's receiver thread
                with contextlib.suppress(trio.RunFinishedError):
                    trio.from_thread.run_sync(arrivals_tx.send_nowait, msg, trio_token=token)

            connector.on_arrival = on_arrival
            self.start_soon(self._forward_arrivals, arrivals_rx)

    async def _forward_arrivals(self, arrivals_rx: trio.MemoryReceiveChannel[KVArrived]) -> None:
        """Received prompts' K/V, reported to the scheduler (the K/V itself waits in the connector's inbox)."""
        async for msg in arrivals_rx:
            await self.send(msg)

    @handles(ExecuteStep)
    async def on_execute(self, msg: ExecuteStep) -> None:
        self._steps_tx.send_nowait((msg.plan.step_id, self.lane.submit(self._run_step, msg.plan)))

    def _run_step(self, plan: StepPlan) -> StepOutcome:
        """On the lane: remote loads before the forward pass (the loaded blocks are reserved, nobody else writes)."""
        loaded = self.runner.load_remote_blocks(plan.remote_loads) if plan.remote_loads else {}
        sampled, timings, prompt_logprobs = self.runner.execute(plan)
        return sampled, timings, loaded, prompt_logprobs

    async def _send_results(self, steps_rx: trio.MemoryReceiveChannel[tuple[int, LaneCall[StepOutcome]]]) -> None:
        try:
            async for step_id, call in steps_rx:
                sampled, timings, loaded, prompt_logprobs = await call.result()
                await self.send(StepResult(step_id=step_id, sampled=sampled, timings=timings, remote_loaded=loaded,
                                           prompt_logprobs=prompt_logprobs))
        finally:
            # The loop is stopping: a step may still be queued on the lane (async scheduling plans one past a stop
            # token). Wait for it, so that no forward pass outlives the run that started it; its result is dropped.
            with trio.CancelScope(shield=True):
                while True:
                    try:
                        _, call = steps_rx.receive_nowait()
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                    await call.done.wait()

    async def on_stop(self) -> None:
        connector = getattr(self.runner, "kv_connector", None)
        if connector is not None:
            connector.on_arrival = None
        if self._owns_lane:
            self.lane.close()
