"""The offline I/O actor: feeds ``LLM.generate``'s requests into the loop and collects their outputs."""

from __future__ import annotations

import trio

from ksana.events import Actor, handles
from ksana.messages import AbortRequest, AddRequests, TokensOut
from ksana.output_processor import SequenceStream
from ksana.request import InferRequest


class OfflineIOActor(Actor):
    """Collects every sequence until all are finished; a stop string match aborts the request in the scheduler.

    A sequence cut by a stop string counts as done only once the scheduler has let go of it (its abort's finish
    delta, or the request's own finish if that came first): otherwise ``all_done`` could stop the loop with the
    ``AbortRequest`` still queued, and the request would keep its blocks in the engine's persistent scheduler.
    """

    name = "io"

    def __init__(self, streams: dict[str, SequenceStream], on_finish=None) -> None:
        self.streams = streams
        self.num_unfinished = len(streams)
        self.all_done = trio.Event()
        self.on_finish = on_finish
        self._aborting: set[str] = set()  # cut by a stop string; the scheduler has not confirmed yet
        if self.num_unfinished == 0:
            self.all_done.set()

    async def submit(self, requests: list[InferRequest]) -> None:
        await self.send(AddRequests(tuple(requests)))

    @handles(TokensOut)
    async def on_tokens(self, msg: TokensOut) -> None:
        for delta in msg.deltas:
            stream = self.streams.get(delta.request_id)
            if stream is None:
                continue
            if stream.output.finished:
                if delta.finish_reason is not None and delta.request_id in self._aborting:
                    self._aborting.discard(delta.request_id)
                    self._count_finished()
                continue
            _text, stopped_by_string = stream.feed(delta)
            if stopped_by_string and delta.finish_reason is None:
                self._aborting.add(delta.request_id)
                await self.send(AbortRequest(delta.request_id, reason="stop"))
            elif stream.output.finished:
                self._count_finished()

    def _count_finished(self) -> None:
        self.num_unfinished -= 1
        if self.on_finish is not None:
            self.on_finish()
        if self.num_unfinished == 0:
            self.all_done.set()
