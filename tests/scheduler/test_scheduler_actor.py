"""The scheduler actor's messages: the next step leaves before this step's tokens, finished requests' blocks go
back through the next step's block exchange, and a step that needs no new block skips the exchange."""

from __future__ import annotations

import trio
import trio.testing

from ksana.cache.cache_manager_actor import CacheManagerActor
from ksana.cache.direct_cache_manager import DirectCacheManager
from ksana.config import BatchSchedulerSetting
from ksana.events import Actor, EventLoop, handles
from ksana.events.clock import VirtualClock
from ksana.messages import AddRequests, AllocateStepBlocks, FreeRequestBlocks, GetCacheStats, TokensOut
from ksana.request import InferRequest
from ksana.sampling_params import SamplingParams
from ksana.scheduler.batch_scheduler import BatchScheduler
from ksana.scheduler.scheduler_actor import SchedulerActor
from tests.kv_hash_oracle import EOS, OracleWorker

NUM_BLOCKS, BLOCK = 64, 4


class RecordingCacheManager(CacheManagerActor):
    def __init__(self) -> None:
        super().__init__(DirectCacheManager(NUM_BLOCKS, BLOCK))
        self.log: list[tuple[str, tuple[str, ...]]] = []

    async def on_allocate(self, msg: AllocateStepBlocks):
        self.log.append(("allocate", msg.release))
        return await super().on_allocate(msg)

    async def on_free(self, msg: FreeRequestBlocks) -> None:
        self.log.append(("free", msg.request_ids))
        await super().on_free(msg)


class OrderCheckingIO(Actor):
    """On each ``TokensOut`` after the first step: the worker has already been sent the following step."""

    name = "io"

    def __init__(self, worker: OracleWorker, num_requests: int) -> None:
        self.worker = worker
        self.num_open = num_requests
        self.num_steps_seen = 0
        self.steps_sent_before_tokens: list[tuple[int, int]] = []  # (this step, steps the worker has had)
        self.all_done = trio.Event()

    @handles(TokensOut)
    async def on_tokens(self, msg: TokensOut) -> None:
        self.num_steps_seen += 1
        num_open_after = self.num_open - sum(d.finish_reason is not None for d in msg.deltas)
        if num_open_after:  # requests still running: the next step exists
            given = self.worker.num_steps + self.loop.mailbox_depths()["worker"]
            self.steps_sent_before_tokens.append((self.num_steps_seen, given))
        self.num_open = num_open_after
        if not self.num_open:
            self.all_done.set()


def _run_three_requests(async_scheduling: bool, max_batch_size: int = 64):
    setting = BatchSchedulerSetting(async_scheduling=async_scheduling, max_batch_size=max_batch_size)
    scheduler = BatchScheduler(setting, BLOCK, NUM_BLOCKS, 4096)
    manager = RecordingCacheManager()
    worker = OracleWorker(NUM_BLOCKS, BLOCK)
    io = OrderCheckingIO(worker, 3)
    requests = [InferRequest(request_id=f"r{n}", prompt_token_ids=[5, 6, 7, 8, 9][:n + 1],
                             sampling_params=SamplingParams(temperature=0.0, max_tokens=n), seed=0,
                             eos_token_ids=(EOS,)) for n in (2, 4, 5)]
    out = {}

    async def main() -> None:
        loop = EventLoop(clock=VirtualClock())
        for actor in (SchedulerActor(scheduler), manager, worker, io):
            loop.register(actor)
        async with loop.running():
            await loop.send(AddRequests(tuple(requests)), sender="test")
            await io.all_done.wait()
            await trio.testing.wait_all_tasks_blocked()
            out["stats"] = await loop.request(GetCacheStats(), sender="test")

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return io, manager, worker, out["stats"]


def test_next_step_before_tokens_and_finished_blocks_released_by_the_next_exchange():
    io, manager, worker, stats = _run_three_requests(async_scheduling=False)
    # Step k's tokens left after step k + 1 was sent: the worker had k + 1 steps when they arrived.
    assert io.steps_sent_before_tokens == [(k, k + 1) for k in range(1, 5)]
    # Blocks of 4 tokens; prompts of 3, 5 and 5 tokens. Step 1 allocates every prompt's blocks. Step 2 fits in
    # them: no exchange. r2 finishes at step 2 and is released by step 3's exchange; step 4 fits again; r4
    # finishes at step 4 and step 5 (where r5 reaches position 8, a new block) releases it; r5 ends the run,
    # with no step to carry it, so it goes alone.
    assert manager.log == [("allocate", ()), ("allocate", ("r2",)), ("allocate", ("r4",)), ("free", ("r5",))]
    assert worker.num_steps == 5
    assert stats.num_free_blocks == NUM_BLOCKS and stats.num_requests_with_blocks == 0


def test_async_scheduling_with_nothing_waiting_plans_each_step_at_the_last_ones_result():
    io, manager, worker, stats = _run_three_requests(async_scheduling=True)
    # Every request runs from step 1 and none waits: each step is planned when the one before it ends (so that an
    # arrival would join it), the same steps, messages and block exchanges as with one step in flight.
    assert io.steps_sent_before_tokens == [(k, k + 1) for k in range(1, 5)]
    assert worker.num_placeholder_rows == 0
    assert manager.log == [("allocate", ()), ("allocate", ("r2",)), ("allocate", ("r4",)), ("free", ("r5",))]
    assert worker.num_steps == 5
    assert stats.num_free_blocks == NUM_BLOCKS and stats.num_requests_with_blocks == 0


def test_async_scheduling_plans_ahead_while_requests_wait():
    io, manager, worker, stats = _run_three_requests(async_scheduling=True, max_batch_size=1)
    # One request at a time (2 + 4 + 5 steps). While r2 and then r4 run, others wait: step 2 is planned as soon
    # as step 1 is sent, and from r4's first step on, step k's tokens leave with step k + 2 sent, its continuing
    # row a placeholder. r5 runs last with nothing behind it: one step at a time again.
    assert worker.num_steps == 11
    assert io.steps_sent_before_tokens[1:4] == [(2, 4), (3, 5), (4, 6)]
    assert io.steps_sent_before_tokens[-4:] == [(k, k + 1) for k in range(7, 11)]
    assert worker.num_placeholder_rows > 0
    assert stats.num_free_blocks == NUM_BLOCKS and stats.num_requests_with_blocks == 0


class StepLogWorker(OracleWorker):
    """The oracle worker that records which requests each step carries."""

    def __init__(self) -> None:
        super().__init__(NUM_BLOCKS, BLOCK, step_latency=lambda plan: 0.01)
        self.steps: list[tuple[str, ...]] = []

    async def on_execute(self, msg) -> None:
        self.steps.append(tuple(row.request_id for row in msg.plan.rows))
        await super().on_execute(msg)


def test_an_arrival_while_a_step_runs_joins_the_next_step():
    """r1 runs alone; r2 arrives halfway through its second step (virtual time) and is in the third."""
    scheduler = BatchScheduler(BatchSchedulerSetting(async_scheduling=True), BLOCK, NUM_BLOCKS, 4096)
    worker = StepLogWorker()
    io = OrderCheckingIO(worker, 2)
    params = SamplingParams(temperature=0.0, max_tokens=5)
    r1, r2 = (InferRequest(request_id=rid, prompt_token_ids=[5, 6, 7], sampling_params=params, seed=0,
                           eos_token_ids=(EOS,)) for rid in ("r1", "r2"))

    async def main() -> None:
        loop = EventLoop(clock=VirtualClock())
        for actor in (SchedulerActor(scheduler), RecordingCacheManager(), worker, io):
            loop.register(actor)
        async with loop.running():
            await loop.send(AddRequests((r1,)), sender="test")
            await trio.sleep(0.015)  # steps take 0.01 s: step 2 runs from 0.01 to 0.02
            await loop.send(AddRequests((r2,)), sender="test")
            await io.all_done.wait()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert worker.steps[:3] == [("r1",), ("r1",), ("r1", "r2")]
