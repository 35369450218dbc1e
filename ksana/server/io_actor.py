"""The serving I/O actor: the only bridge between HTTP handlers and the engine's event loop.

A handler submits its engine requests as one ``RequestGroup`` (the ``n`` samples of a completion, the beams of one
beam-search step) and reads their ``RequestDelta``s from the group's trio memory channel. The actor routes each
step's ``TokensOut`` into those channels without ever blocking (unbounded buffers: a slow client must not stall the
step loop), and observes the request metrics on the way. Leaving the group's ``async with`` before every request
finished (client gone, error, stop string) aborts the rest, so their blocks go back to the pool within one step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import attrs
import trio

from ksana.events import Actor, handles
from ksana.messages import AbortRequest, AddRequest, CacheStats, GetCacheStats, RequestDelta, TokensOut
from ksana.request import InferRequest
from ksana.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)


class ServerShuttingDown(Exception):
    """The server is stopping: no new requests, and open streams end with an error."""


_SHUTDOWN = object()  # channel sentinel: the group's handler must end its response now


@attrs.define(eq=False)
class _Tracked:
    """Per engine request: where its deltas go and what its latency metrics need."""

    group: RequestGroup | None
    arrival: float
    internal: bool  # a beam-search expansion: counted, but kept out of the latency histograms
    last_token_time: float | None = None
    num_output_tokens: int = 0


class RequestGroup:
    """The engine requests of one HTTP request; an async context manager that aborts what is left on exit."""

    def __init__(self, io: ServerIOActor, request_ids: Sequence[str]) -> None:
        self._io = io
        self.request_ids = tuple(request_ids)
        self.unfinished = set(request_ids)
        self._aborted: set[str] = set()
        self._send, self._receive = trio.open_memory_channel(math.inf)

    async def __aenter__(self) -> RequestGroup:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()

    async def receive(self) -> RequestDelta:
        """The next delta of any request in the group; raises ``ServerShuttingDown`` when the server stops."""
        item = await self._receive.receive()
        if item is _SHUTDOWN:
            raise ServerShuttingDown("the server is shutting down")
        return item

    def receive_ready(self) -> list[RequestDelta]:
        """Every delta already waiting, without blocking (a handler that fell behind catches up in one write)."""
        items = []
        while True:
            try:
                item = self._receive.receive_nowait()
            except trio.WouldBlock:
                return items
            if item is _SHUTDOWN:
                raise ServerShuttingDown("the server is shutting down")
            items.append(item)

    async def abort(self, request_id: str, reason: str = "abort") -> None:
        if request_id in self.unfinished and request_id not in self._aborted:
            self._aborted.add(request_id)
            await self._io.send(AbortRequest(request_id, reason=reason))

    async def aclose(self) -> None:
        """Abort every unfinished request and detach; safe under cancellation (a client that went away)."""
        with trio.CancelScope(shield=True):
            for request_id in list(self.unfinished):
                await self.abort(request_id)
        self._io._detach(self)
        self._receive.close()

    # ---- called by the actor -------------------------------------------------------------------------------------
    def _deliver(self, delta: RequestDelta) -> None:
        if delta.finish_reason is not None:
            self.unfinished.discard(delta.request_id)
        try:
            self._send.send_nowait(delta)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    def _shutdown(self) -> None:
        try:
            self._send.send_nowait(_SHUTDOWN)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


class ServerIOActor(Actor):
    """Handles ``TokensOut``; HTTP handlers call ``submit``, ``cache_stats`` and read their groups."""

    name = "io"

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.is_shutting_down = False
        self._tracked: dict[str, _Tracked] = {}
        self._groups: set[RequestGroup] = set()

    @property
    def num_tracked(self) -> int:
        """Engine requests that have not yet reported their finish."""
        return len(self._tracked)

    async def submit(self, requests: Sequence[InferRequest], internal: bool = False) -> RequestGroup:
        """Register the requests' channel first, then send them: no delta can arrive before its channel exists."""
        if self.is_shutting_down:
            raise ServerShuttingDown("the server is shutting down")
        group = RequestGroup(self, [r.request_id for r in requests])
        self._groups.add(group)
        now = self.now()
        for request in requests:
            self._tracked[request.request_id] = _Tracked(group=group, arrival=now, internal=internal)
        self.metrics.forward_req_total_num.inc(len(requests))
        num_sent = 0
        try:
            for request in requests:
                if not internal:
                    self.metrics.input_token_len.observe(request.num_prompt_tokens)
                await self.send(AddRequest(request))
                num_sent += 1
        except BaseException:  # cancelled while the scheduler's mailbox was full: undo what was sent
            for request in requests[num_sent:]:
                self._tracked.pop(request.request_id, None)
                group.unfinished.discard(request.request_id)
            await group.aclose()
            raise
        return group

    async def cache_stats(self) -> CacheStats:
        stats = await self.request(GetCacheStats())
        self.metrics.set_cache_stats(stats)
        return stats

    def begin_shutdown(self) -> int:
        """Refuse new requests and tell every open group to end its response; returns how many were open."""
        self.is_shutting_down = True
        groups = list(self._groups)
        for group in groups:
            group._shutdown()
        return len(groups)

    def _detach(self, group: RequestGroup) -> None:
        self._groups.discard(group)
        for request_id in group.request_ids:
            tracked = self._tracked.get(request_id)
            if tracked is not None:
                tracked.group = None  # its finish delta still comes, for the metrics

    @handles(TokensOut)
    async def on_tokens(self, msg: TokensOut) -> None:
        metrics = self.metrics
        metrics.batch_scheduler_batch_size.set(msg.num_running)
        metrics.batch_scheduler_waiting_size.set(msg.num_waiting)
        now = self.now()
        for delta in msg.deltas:
            tracked = self._tracked.get(delta.request_id)
            if tracked is None:
                continue
            if delta.new_token_ids:
                self._observe_tokens(tracked, delta, now)
                if delta.num_draft_tokens:
                    metrics.observe_spec(delta.num_draft_tokens, delta.num_accepted_draft_tokens)
            if delta.finish_reason is not None:
                self._observe_finish(tracked, delta, now)
                del self._tracked[delta.request_id]
            if tracked.group is not None:
                tracked.group._deliver(delta)

    def _observe_tokens(self, tracked: _Tracked, delta: RequestDelta, now: float) -> None:
        first = tracked.num_output_tokens == 0
        tracked.num_output_tokens += len(delta.new_token_ids)
        if not tracked.internal:
            if first:
                self.metrics.time_to_first_token_us.observe((now - tracked.arrival) * 1e6)
                if delta.num_cached_tokens:
                    self.metrics.prefix_cache_hit_req_num.inc()
                    self.metrics.prefix_cache_hit_token_num.inc(delta.num_cached_tokens)
            elif tracked.last_token_time is not None:
                self.metrics.inter_token_interval_latency_us.observe((now - tracked.last_token_time) * 1e6)
        tracked.last_token_time = now

    def _observe_finish(self, tracked: _Tracked, delta: RequestDelta, now: float) -> None:
        metrics = self.metrics
        if delta.error is not None:
            metrics.forward_req_error_num.inc()
            if "waited longer" in delta.error:
                metrics.forward_req_timeout_num.inc()
            logger.info("request %s failed: %s", delta.request_id, delta.error)
        elif delta.finish_reason == "abort":
            metrics.forward_req_aborted_num.inc()
        if delta.error is None and not tracked.internal:
            metrics.total_latency_us.observe((now - tracked.arrival) * 1e6)
            metrics.output_token_len.observe(tracked.num_output_tokens)
