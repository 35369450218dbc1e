"""The worker actor: owns the model runner; forward passes run in a thread so the loop keeps routing."""

from __future__ import annotations

from events import Actor, handles, run_blocking
from events.messages import ExecuteStep, StepResult
from ksana.worker.model_runner import ModelRunner


class WorkerActor(Actor):
    name = "worker"

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    @handles(ExecuteStep)
    async def on_execute(self, msg: ExecuteStep) -> None:
        loaded = {}
        if msg.plan.remote_loads:  # before the forward pass: the loaded blocks are reserved, nobody else writes
            loaded = await run_blocking(self.runner.load_remote_blocks, msg.plan.remote_loads)
        sampled, timings = await run_blocking(self.runner.execute, msg.plan)
        await self.send(StepResult(step_id=msg.plan.step_id, sampled=sampled, timings=timings,
                                   remote_loaded=loaded))
