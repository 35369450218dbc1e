"""The workload replayer: takes the I/O actor's place, sends each trace request at its arrival time on the
virtual clock and records when each of its tokens comes out."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import attrs
import trio

from ksana.bench.trace import TraceRequest, prompt_ids
from ksana.events import Actor, handles
from ksana.messages import AddRequest, TokensOut
from ksana.request import InferRequest
from ksana.sampling_params import SamplingParams


@attrs.define
class RequestTimeline:
    """One request's life on the virtual clock (seconds from the run's start)."""

    arrival_s: float
    prompt_len: int
    token_times_s: list[float] = attrs.field(factory=list)
    first_scheduled_s: float | None = None
    finished_s: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    error: str | None = None


class WorkloadReplayer(Actor):
    name = "io"

    def __init__(self, requests: Sequence[TraceRequest], vocab_size: int, eos_token_ids: tuple[int, ...],
                 max_token_len: int, seed: int = 0, admission_delay_s: float = 0.0,
                 delivery_s: Callable[[int, float], float] | None = None,
                 on_progress: Callable[[int], None] | None = None) -> None:
        """``admission_delay_s``: how long after its arrival a request reaches the engine (a server's HTTP
        handling, ``LatencyFit.serving_admission_ms``); ``delivery_s(rows, position)``: how long after a step's
        result one of its tokens reaches its client (``LatencyFit.delivery_s``; each token's position in the
        step's hand-out window drawn at random, seeded); latencies count from the arrival."""
        self.requests = list(requests)
        self.timelines = [RequestTimeline(r.arrival_time_s, r.prompt_len) for r in self.requests]
        self._infer: dict[str, tuple[int, InferRequest]] = {}
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.max_token_len = max_token_len
        self.seed = seed
        self.admission_delay_s = admission_delay_s
        self.delivery_s = delivery_s
        self._positions = random.Random(seed)
        self.on_progress = on_progress
        self.num_open = len(self.requests)
        self.all_done = trio.Event()
        self.started_at = 0.0

    async def on_start(self) -> None:
        self.started_at = trio.current_time()
        self.start_soon(self._arrive)

    async def _arrive(self) -> None:
        for index, request in enumerate(self.requests):
            await trio.sleep_until(self.started_at + request.arrival_time_s + self.admission_delay_s)
            infer = InferRequest(
                request_id=f"sim-{index}", prompt_token_ids=prompt_ids(request, index, self.vocab_size, self.seed),
                sampling_params=SamplingParams(temperature=0.0, max_tokens=request.output_len, ignore_eos=True),
                seed=index, arrival_time=trio.current_time(), eos_token_ids=self.eos_token_ids,
                max_token_len=self.max_token_len)
            self._infer[infer.request_id] = (index, infer)
            await self.send(AddRequest(infer))

    @handles(TokensOut)
    async def on_tokens(self, msg: TokensOut) -> None:
        now = trio.current_time() - self.started_at
        for delta in msg.deltas:
            index, infer = self._infer[delta.request_id]
            timeline = self.timelines[index]
            delivered = now
            if self.delivery_s is not None:  # a stream's chunks arrive in order: no token overtakes the one before
                delivered = max(now + self.delivery_s(len(msg.deltas), self._positions.random()),
                                timeline.token_times_s[-1] if timeline.token_times_s else 0.0)
            timeline.token_times_s += [delivered] * len(delta.new_token_ids)
            if delta.finish_reason is not None:
                timeline.finished_s = delivered
                timeline.error = delta.error
                timeline.num_preemptions = infer.num_preemptions
                timeline.num_cached_tokens = max(timeline.num_cached_tokens, delta.num_cached_tokens)
                if infer.first_scheduled_time is not None:
                    timeline.first_scheduled_s = infer.first_scheduled_time - self.started_at
                del self._infer[delta.request_id]
                self.num_open -= 1
                if self.on_progress is not None:
                    self.on_progress(1)
                if self.num_open == 0:
                    self.all_done.set()
            elif delta.num_cached_tokens:
                timeline.num_cached_tokens = max(timeline.num_cached_tokens, delta.num_cached_tokens)
