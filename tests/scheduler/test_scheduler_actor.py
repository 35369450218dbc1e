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


def _run_three_requests(async_scheduling: bool):
    scheduler = BatchScheduler(BatchSchedulerSetting(async_scheduling=async_scheduling), BLOCK, NUM_BLOCKS, 4096)
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


def test_async_scheduling_keeps_two_steps_in_flight_and_plans_no_step_past_a_known_end():
    io, manager, worker, stats = _run_three_requests(async_scheduling=True)
    # Step k + 1 is planned when step k is sent, so step k's tokens leave after step k + 2 was: the worker had
    # k + 2 steps, except at the end, where the last step (5) was planned with step 4's result.
    assert io.steps_sent_before_tokens == [(1, 3), (2, 4), (3, 5), (4, 5)]
    # The oracle filled every step's continuing rows from its previous step: 2 + 3 + 2 + 1 rows after step 1.
    assert worker.num_placeholder_rows == 3 + 2 + 2 + 1
    # The same five steps as one step in flight: a request whose pending token reaches max_tokens is not planned
    # again (r2 ends at step 2, r4 at 4, r5 at 5). Prompts of 3, 5 and 5 tokens in blocks of 4: step 1 allocates
    # the prompts' blocks; steps 2 and 3 fit in them; step 4, planned at step 2's result, carries r2's release;
    # step 5 (r5 at position 8) needs a block. At step 4's result nothing is left to plan (r5's last step is in
    # flight), so r4 is freed alone, and r5 at the end.
    assert manager.log == [("allocate", ()), ("allocate", ("r2",)), ("allocate", ()), ("free", ("r4",)),
                           ("free", ("r5",))]
    assert worker.num_steps == 5
    assert stats.num_free_blocks == NUM_BLOCKS and stats.num_requests_with_blocks == 0
