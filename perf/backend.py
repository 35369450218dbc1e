"""ModelPerfBackend: the perf-mode actor that takes the I/O actor's place in the engine's event loop.

The seed's flow, in this engine: ``start_perf()`` blocks until every batch is done; for each batch ``schedule()``
runs the warmup rounds, then the stat rounds. A round builds fresh ``InferRequest``s of the batch's shapes (the
same prompt tokens every round; ``max_tokens=1``, ``ignore_eos``; each one's cached prefix marked as computed) and
submits them through ``add_infer_request`` in one ``AddRequests`` message, so the serving scheduler plans them as
one step; ``update_with_generation_result()`` (the ``TokensOut`` handler) releases the batch waiter when every
request has finished. A request that ends after one token frees its blocks, so the KV pool is back to its starting
state and the next round executes the same shapes. The round's latencies come from the loop's message trace
(scheduling), the model runner's own timings (forward, sampling) and the operator profiler.
"""

from __future__ import annotations

import logging
import random
import sys
from collections.abc import Sequence

import attrs
import trio
import trio.testing
from tqdm.auto import tqdm

from ksana.events import Actor, TraceRecord, handles
from ksana.messages import AddRequests, CacheStats, GetCacheStats, StepPlan, StepTimings, TokensOut
from ksana.perf.operator_profiler import OperatorProfiler, OperatorTimes
from ksana.perf.perf_config import BatchSpec, PerfConfigError
from ksana.request import FinishReason, InferRequest
from ksana.sampling_params import SamplingParams
from ksana.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# One greedy token per request: each round is exactly one engine step.
ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


class PerfRunError(PerfConfigError):
    """A batch did not run as one step (rejected, split or stalled): bad input, reported like a config error."""


@attrs.frozen
class ExecutedStep:
    step_id: int
    num_rows: int
    num_tokens: int
    num_decodes: int
    timings: StepTimings


class RecordingRunner:
    """The engine's ``ModelRunner`` behind the serving worker actor, noting each step's shape and timings.

    Perf mode plugs it in with ``engine.build_loop(backend, worker=WorkerActor(recorder, engine.forward_lane))``,
    ``recorder = RecordingRunner(engine.runner)``: the worker, its forward thread and the runner are the serving
    ones, the backend just reads what they measured.
    """

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.steps: list[ExecutedStep] = []
        self.num_started = 0

    @property
    def is_executing(self) -> bool:
        return self.num_started > len(self.steps)

    def execute(self, plan: StepPlan):
        self.num_started += 1
        sampled, timings, prompt_logprobs = self.runner.execute(plan)
        num_decodes = sum(1 for row in plan.rows if row.num_new_tokens == 1)
        self.steps.append(ExecutedStep(plan.step_id, len(plan.rows), plan.num_tokens, num_decodes, timings))
        return sampled, timings, prompt_logprobs


@attrs.frozen
class RoundMetrics:
    """One round (one engine step) in milliseconds.

    From the trace: ``schedule_ms`` (the scheduler's handling of ``AddRequests``: queueing, planning, the block
    exchange, sending ``ExecuteStep``), of which ``block_allocation_ms`` is the ``AllocateStepBlocks`` round trip;
    ``dispatch_ms`` (``ExecuteStep`` waiting in the worker's mailbox); ``worker_ms`` (from the worker taking the
    ``ExecuteStep`` to sending its ``StepResult``: thread hops, prepare, forward, sampling); ``result_queue_ms`` and ``update_ms`` (``StepResult`` queueing and
    the scheduler's update); ``output_queue_ms`` (``TokensOut`` queueing); ``step_ms`` from the start of
    scheduling to the end of the update; ``round_ms`` from sending the requests to receiving their tokens.
    From the model runner: ``prepare_ms``, ``forward_ms`` (model forward and lm_head), ``sample_ms``.
    """

    index: int
    step_ms: float
    round_ms: float
    schedule_ms: float
    block_allocation_ms: float
    dispatch_ms: float
    worker_ms: float
    prepare_ms: float
    forward_ms: float
    sample_ms: float
    result_queue_ms: float
    update_ms: float
    output_queue_ms: float
    num_scheduled_requests: int
    num_scheduled_tokens: int
    operators: OperatorTimes | None = None


TIMING_FIELDS: tuple[str, ...] = (
    "step_ms", "round_ms", "schedule_ms", "block_allocation_ms", "dispatch_ms", "worker_ms", "prepare_ms",
    "forward_ms", "sample_ms", "result_queue_ms", "update_ms", "output_queue_ms",
)


@attrs.frozen
class BatchResult:
    batch: BatchSpec
    num_warmup_rounds: int
    rounds: tuple[RoundMetrics, ...]  # the stat rounds


def _ms(seconds: float) -> float:
    return seconds * 1000.0


class ModelPerfBackend(Actor):
    """Replays fixed batches through the serving scheduler, cache manager and worker; collects their latencies."""

    name = "io"

    def __init__(
        self,
        batches: Sequence[BatchSpec],
        *,
        warmup_rounds: int,
        stat_rounds: int,
        vocab_size: int,
        recorder: RecordingRunner,
        profiler: OperatorProfiler | None = None,
        eos_token_ids: tuple[int, ...] = (),
        seed: int = 42,
        source: str = "batch_config.json",
        progress: bool = True,
    ) -> None:
        self.batches = tuple(batches)
        self.warmup_rounds = warmup_rounds
        self.stat_rounds = stat_rounds
        self.vocab_size = vocab_size
        self.recorder = recorder
        self.profiler = profiler
        self.eos_token_ids = eos_token_ids
        self.seed = seed
        self.source = source
        self.progress = progress
        self._pending: set[str] = set()
        self._failure: str | None = None
        self._batch_waiter = trio.Event()

    # ---- the seed's flow --------------------------------------------------------------------------------------
    async def start_perf(self) -> list[BatchResult]:
        """Run every batch (warmup, then stat rounds); returns when all are done."""
        results = []
        with tqdm(total=len(self.batches), desc="batches", unit="batch", file=sys.stderr,
                  disable=not self.progress, position=0) as bar:
            for batch in self.batches:
                prompts = self._prompts(batch)
                results.append(await self.schedule(batch, prompts))
                bar.update(1)
        return results

    async def add_infer_request(self, requests: Sequence[InferRequest]) -> None:
        """Submit a round's requests in one message, so the scheduler queues them all before it plans."""
        await self.send(AddRequests(tuple(requests)))

    async def schedule(self, batch: BatchSpec, prompts: list[list[int]]) -> BatchResult:
        """The batch's warmup rounds, then its stat rounds, each replaying the identical batch as one step."""
        rounds = []
        total = self.warmup_rounds + self.stat_rounds
        with tqdm(total=total, desc=f"{batch.name} warmup", unit="round", file=sys.stderr, leave=False,
                  disable=not self.progress, position=1) as bar:
            for index in range(total):
                if index == self.warmup_rounds:
                    bar.set_description(f"{batch.name} stat")
                metrics = await self._run_round(batch, prompts, index - self.warmup_rounds)
                if index >= self.warmup_rounds:
                    rounds.append(metrics)
                bar.update(1)
        return BatchResult(batch, self.warmup_rounds, tuple(rounds))

    @handles(TokensOut)
    async def update_with_generation_result(self, msg: TokensOut) -> None:
        """Note each finished request of the round; the last one releases the batch waiter."""
        for delta in msg.deltas:
            if delta.request_id not in self._pending or delta.finish_reason is None:
                continue
            if delta.error is not None or delta.finish_reason != FinishReason.LENGTH:
                self._failure = self._failure or (
                    f"request {delta.request_id} ended with {delta.finish_reason}: {delta.error or 'no error given'}")
            self._pending.discard(delta.request_id)
        if not self._pending:
            self._batch_waiter.set()

    # ---- one round --------------------------------------------------------------------------------------------
    def _prompts(self, batch: BatchSpec) -> list[list[int]]:
        """Token ids from a seeded RNG: the same for every round of the batch and every run."""
        rng = random.Random(f"{self.seed}:{batch.name}")
        return [
            [rng.randrange(self.vocab_size) for _ in range(spec.sequence_len)]
            for spec in batch.requests for _ in range(spec.request_num)
        ]

    def _requests(self, batch: BatchSpec, prompts: list[list[int]]) -> list[InferRequest]:
        specs = [spec for spec in batch.requests for _ in range(spec.request_num)]
        return [
            InferRequest(
                request_id=f"{batch.name}-{i}",
                prompt_token_ids=prompt,
                sampling_params=ONE_TOKEN,
                seed=self.seed + i,
                eos_token_ids=self.eos_token_ids,
                num_computed_tokens=spec.num_cached_tokens,
                num_cached_tokens=spec.num_cached_tokens,
            )
            for i, (spec, prompt) in enumerate(zip(specs, prompts, strict=True))
        ]

    async def _run_round(self, batch: BatchSpec, prompts: list[list[int]], index: int) -> RoundMetrics:
        requests = self._requests(batch, prompts)
        self._pending = {r.request_id for r in requests}
        self._failure = None
        self._batch_waiter = trio.Event()
        trace = self.loop.trace
        trace_mark, steps_mark = trace.num_recorded, len(self.recorder.steps)
        if self.profiler is not None:
            self.profiler.reset()

        await self.add_infer_request(requests)
        await self._wait_for_round(batch)
        # Every handler of the round has returned once all tasks are idle, so its trace records are complete.
        await trio.testing.wait_all_tasks_blocked()
        if self._failure is not None:
            raise PerfRunError(f"{self.source}: {batch.name} did not run: {self._failure}")
        stats: CacheStats = await self.request(GetCacheStats())
        if stats.num_free_blocks != stats.num_total_blocks:
            raise RuntimeError(f"{batch.name}: {stats.num_used_blocks} KV blocks still in use after the round")

        num_new = trace.num_recorded - trace_mark
        records = trace.records()[len(trace) - num_new:] if num_new else []
        steps = self.recorder.steps[steps_mark:]
        return self._round_metrics(batch, index, records, steps)

    async def _wait_for_round(self, batch: BatchSpec) -> None:
        """Wait for the batch waiter; if the engine goes idle first (nothing running, requests still open),
        the batch can never be scheduled, which is an error rather than a hang."""
        async with trio.open_nursery() as nursery:

            async def watch_for_stall() -> None:
                idle_checks = 0
                while idle_checks < 2:
                    await trio.testing.wait_all_tasks_blocked(cushion=0.05)
                    if self.recorder.is_executing:
                        idle_checks = 0
                        await trio.sleep(0.2)
                    else:
                        idle_checks += 1
                self._failure = self._failure or (
                    f"the scheduler left {len(self._pending)} of its requests waiting (the batch does not fit)")
                self._batch_waiter.set()

            nursery.start_soon(watch_for_stall)
            await self._batch_waiter.wait()
            nursery.cancel_scope.cancel()

    def _round_metrics(self, batch: BatchSpec, index: int, records: list[TraceRecord],
                       steps: list[ExecutedStep]) -> RoundMetrics:
        by_type: dict[str, list[TraceRecord]] = {}
        for record in records:
            by_type.setdefault(record.message_type, []).append(record)
        executes = by_type.get("ExecuteStep", [])
        if len(executes) != 1 or len(steps) != 1 or steps[0].num_rows != batch.num_requests:
            shapes = ", ".join(f"{s.num_rows} requests/{s.num_tokens} tokens" for s in steps)
            raise PerfRunError(
                f"{self.source}: {batch.name} ({batch.num_requests} requests, {batch.num_tokens} tokens) did not run "
                f"as one step: the scheduler made {len(steps)} ({shapes}); check max_step_tokens, max_batch_size, "
                "split_fuse_token_num and the KV pool")
        add, alloc = by_type["AddRequests"][0], by_type["AllocateStepBlocks"][0]
        execute, result, out = executes[0], by_type["StepResult"][0], by_type["TokensOut"][-1]
        step = steps[0]
        timings = step.timings
        operators = None
        if self.profiler is not None:
            operators = self.profiler.take().with_sampler(timings.sample_s)
        return RoundMetrics(
            index=index,
            step_ms=_ms(result.finished - add.started),
            round_ms=_ms(out.started - add.sent),
            schedule_ms=_ms(add.handling_s),
            block_allocation_ms=_ms(alloc.finished - alloc.sent),
            dispatch_ms=_ms(execute.queue_s),
            worker_ms=_ms(result.sent - execute.started),
            prepare_ms=_ms(timings.prepare_s),
            forward_ms=_ms(timings.forward_s),
            sample_ms=_ms(timings.sample_s),
            result_queue_ms=_ms(result.queue_s),
            update_ms=_ms(result.handling_s),
            output_queue_ms=_ms(out.queue_s),
            num_scheduled_requests=step.num_rows,
            num_scheduled_tokens=step.num_tokens,
            operators=operators,
        )
