"""The worker actor: owns the model runner; forward passes run on a lane (one thread) so the loop keeps routing."""

from __future__ import annotations

from events import Actor, BlockingLane, handles
from events.messages import ExecuteStep, StepResult
from ksana.worker.model_runner import ModelRunner


class WorkerActor(Actor):
    """``lane``: the thread the forward passes run on. The engine passes its own, which outlives each loop, so
    every forward of its life runs on one thread; without one the actor opens a lane and closes it on stop."""

    name = "worker"

    def __init__(self, runner: ModelRunner, lane: BlockingLane | None = None) -> None:
        self.runner = runner
        self._owns_lane = lane is None
        self.lane = lane if lane is not None else BlockingLane("ksana-worker")

    @handles(ExecuteStep)
    async def on_execute(self, msg: ExecuteStep) -> None:
        loaded = {}
        if msg.plan.remote_loads:  # before the forward pass: the loaded blocks are reserved, nobody else writes
            loaded = await self.lane.run(self.runner.load_remote_blocks, msg.plan.remote_loads)
        sampled, timings = await self.lane.run(self.runner.execute, msg.plan)
        await self.send(StepResult(step_id=msg.plan.step_id, sampled=sampled, timings=timings,
                                   remote_loaded=loaded))

    async def on_stop(self) -> None:
        if self._owns_lane:
            self.lane.close()
