"""Runs the real scheduler and cache-manager actors against the KV-hash oracle worker on a virtual clock."""

from __future__ import annotations

import random

import attrs
import trio
import trio.testing

from ksana.cache.cache_manager_actor import CacheManagerActor, make_cache_manager
from ksana.config import BatchSchedulerSetting
from ksana.events import Actor, EventLoop, handles
from ksana.events.clock import VirtualClock
from ksana.messages import AbortRequest, AddRequest, CacheStats, GetCacheStats, TokensOut
from ksana.request import InferRequest
from ksana.sampling_params import SamplingParams
from ksana.scheduler.batch_scheduler import BatchScheduler
from ksana.scheduler.scheduler_actor import SchedulerActor
from tests.kv_hash_oracle import EOS, VOCAB, OracleWorker


@attrs.define
class Collected:
    tokens: list[int] = attrs.field(factory=list)
    finish_reason: str | None = None
    error: str | None = None


class CollectorIO(Actor):
    name = "io"

    def __init__(self, num_requests: int) -> None:
        self.results: dict[str, Collected] = {}
        self.num_open = num_requests
        self.all_done = trio.Event()

    @handles(TokensOut)
    async def on_tokens(self, msg: TokensOut) -> None:
        for delta in msg.deltas:
            result = self.results.setdefault(delta.request_id, Collected())
            assert result.finish_reason is None, f"delta after finish for {delta.request_id}"
            result.tokens.extend(delta.new_token_ids)
            if delta.finish_reason is not None:
                result.finish_reason = delta.finish_reason
                result.error = delta.error
                self.num_open -= 1
                if self.num_open == 0:
                    self.all_done.set()


@attrs.define
class Arrival:
    time: float
    request_id: str
    prompt: list[int]
    max_tokens: int
    abort_at: float | None = None


@attrs.define
class RunResult:
    results: dict[str, Collected]
    stats_after: CacheStats
    scheduler: BatchScheduler
    worker: OracleWorker
    manager: object = None


def random_arrivals(rng: random.Random, num: int, max_prompt: int = 60, max_new: int = 30,
                    abort_fraction: float = 0.0) -> list[Arrival]:
    arrivals, t = [], 0.0
    for i in range(num):
        t += rng.expovariate(20.0)
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, max_prompt))]
        abort_at = t + rng.uniform(0.0, 0.3) if rng.random() < abort_fraction else None
        arrivals.append(Arrival(t, f"r{i}", prompt, rng.randint(1, max_new), abort_at))
    return arrivals


def random_arrivals_with_shared_prefixes(rng: random.Random, num: int, num_prefixes: int = 3,
                                         max_prefix: int = 40, max_suffix: int = 20,
                                         max_new: int = 20) -> list[Arrival]:
    """Arrivals whose prompts start with one of a few shared prefixes (some prompts are a whole prefix, or a
    prefix plus nothing but a few tokens), so the prefix cache hits, partially and fully."""
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(1, max_prefix))] for _ in range(num_prefixes)]
    arrivals, t = [], 0.0
    for i in range(num):
        t += rng.expovariate(20.0)
        prefix = rng.choice(prefixes)
        suffix = [rng.randrange(1, VOCAB) for _ in range(rng.choice([0, 1, rng.randint(1, max_suffix)]))]
        arrivals.append(Arrival(t, f"r{i}", prefix + suffix, rng.randint(1, max_new)))
    return arrivals


def run_workload(arrivals: list[Arrival], setting: BatchSchedulerSetting, num_blocks: int, block_size: int,
                 max_token_len: int = 4096, step_latency=lambda plan: 0.005 + 0.0005 * plan.num_tokens,
                 sliding_window: int | None = None, num_swa_blocks: int = 0,
                 stop_token_ids: tuple[int, ...] = ()) -> RunResult:
    """``setting.enable_auto_prefix_cache`` picks the prefix cache manager; ``sliding_window`` adds an SWA pool
    of ``num_swa_blocks`` (default: as many as the FA pool) and a sliding layer to the oracle; ``stop_token_ids``
    ends a request at the first of them it samples."""
    scheduler = BatchScheduler(setting, block_size, num_blocks, max_token_len)
    num_swa_blocks = (num_swa_blocks or num_blocks) if sliding_window else 0
    manager = make_cache_manager(num_blocks, block_size, setting.enable_auto_prefix_cache, sliding_window,
                                 num_swa_blocks)
    worker = OracleWorker(num_blocks, block_size, step_latency, sliding_window, num_swa_blocks)
    io = CollectorIO(len(arrivals))
    out: dict = {}

    async def main() -> None:
        loop = EventLoop(clock=VirtualClock())
        for actor in (SchedulerActor(scheduler), CacheManagerActor(manager), worker, io):
            loop.register(actor)

        async def arrive(arrival: Arrival) -> None:
            await trio.sleep_until(arrival.time)
            request = InferRequest(
                request_id=arrival.request_id, prompt_token_ids=arrival.prompt,
                sampling_params=SamplingParams(temperature=0.0, max_tokens=arrival.max_tokens,
                                               stop_token_ids=list(stop_token_ids)),
                seed=0, arrival_time=arrival.time, eos_token_ids=(EOS,),
            )
            await loop.send(AddRequest(request), sender="test")
            if arrival.abort_at is not None:
                await trio.sleep_until(arrival.abort_at)
                await loop.send(AbortRequest(arrival.request_id), sender="test")

        async with trio.open_nursery() as nursery:
            await nursery.start(loop.run)
            async with trio.open_nursery() as arrivals_nursery:
                for arrival in arrivals:
                    arrivals_nursery.start_soon(arrive, arrival)
            await io.all_done.wait()
            out["stats"] = await loop.request(GetCacheStats(), sender="test")
            loop.shutdown()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return RunResult(io.results, out["stats"], scheduler, worker, manager)
