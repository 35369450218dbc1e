"""The offline I/O actor: feeds ``LLM.generate``'s requests into the loop and collects their outputs."""

from __future__ import annotations

import trio

from events import Actor, handles
from events.messages import AbortRequest, AddRequests, TokensOut
from ksana.output_processor import SequenceStream
from ksana.request import InferRequest


class OfflineIOActor(Actor):
    """Collects every sequence until all are finished; a stop string match aborts the request in the scheduler."""

    name = "io"

    def __init__(self, streams: dict[str, SequenceStream], on_finish=None) -> None:
        self.streams = streams
        self.num_unfinished = len(streams)
        self.all_done = trio.Event()
        self.on_finish = on_finish
        if self.num_unfinished == 0:
            self.all_done.set()

    async def submit(self, requests: list[InferRequest]) -> None:
        await self.send(AddRequests(tuple(requests)))

    @handles(TokensOut)
    async def on_tokens(self, msg: TokensOut) -> None:
        for delta in msg.deltas:
            stream = self.streams.get(delta.request_id)
            if stream is None or stream.output.finished:
                continue
            _text, stopped_by_string = stream.feed(delta)
            if stopped_by_string:
                await self.send(AbortRequest(delta.request_id, reason="stop"))
            if stream.output.finished:
                self.num_unfinished -= 1
                if self.on_finish is not None:
                    self.on_finish()
                if self.num_unfinished == 0:
                    self.all_done.set()
