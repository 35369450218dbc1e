"""The worker actor: owns the model runner; forward passes run in a thread so the loop keeps routing."""

from __future__ import annotations

import trio

from events import Actor, handles
from events.messages import ExecuteStep, StepResult
from ksana.worker.model_runner import ModelRunner


class WorkerActor(Actor):
    name = "worker"

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    @handles(ExecuteStep)
    async def on_execute(self, msg: ExecuteStep) -> None:
        sampled, timings = await trio.to_thread.run_sync(self.runner.execute, msg.plan)
        await self.send(StepResult(step_id=msg.plan.step_id, sampled=sampled, timings=timings))
