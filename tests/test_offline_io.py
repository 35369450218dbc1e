"""The offline I/O actor: a sequence cut by a stop string is done only once the scheduler has let it go."""

from __future__ import annotations

import trio
import trio.testing

from ksana.builtin import resolve_model_dir
from ksana.events import Actor, EventLoop, handles
from ksana.messages import AbortRequest, RequestDelta, TokensOut
from ksana.offline_io import OfflineIOActor
from ksana.output_processor import SequenceStream
from ksana.sampling_params import SamplingParams
from ksana.tokenizer import load_tokenizer

TOKENIZER = load_tokenizer(resolve_model_dir("demo"))


class AbortRecorder(Actor):
    name = "scheduler"

    def __init__(self) -> None:
        self.aborts: list[AbortRequest] = []

    @handles(AbortRequest)
    async def on_abort(self, msg: AbortRequest) -> None:
        self.aborts.append(msg)


def run(script) -> None:
    async def main() -> None:
        params = SamplingParams(temperature=0.0, max_tokens=50, stop=["world"])
        streams = {rid: SequenceStream.create(0, TOKENIZER, [1, 2], params) for rid in ("a", "b")}
        io, scheduler = OfflineIOActor(streams), AbortRecorder()
        loop = EventLoop()
        loop.register(io)
        loop.register(scheduler)
        async with loop.running():
            async def deliver(*deltas: RequestDelta) -> None:
                await loop.send(TokensOut(deltas), sender="scheduler")
                await trio.testing.wait_all_tasks_blocked()

            await script(io, scheduler, streams, deliver)

    trio.run(main)


def delta(rid: str, text: str, finish_reason: str | None = None) -> RequestDelta:
    ids = tuple(TOKENIZER.encode(text, add_special_tokens=False)) if text else ()
    return RequestDelta(rid, new_token_ids=ids, new_logprobs=(0.0,) * len(ids), finish_reason=finish_reason)


def test_stop_string_waits_for_the_schedulers_finish_before_all_done():
    async def script(io, scheduler, streams, deliver):
        await deliver(delta("a", "hello world again"), delta("b", "nothing to see", finish_reason="length"))
        assert streams["a"].output.finish_reason == "stop" and streams["a"].text == "hello "
        assert [(m.request_id, m.reason) for m in scheduler.aborts] == [("a", "stop")]
        assert io.num_unfinished == 1 and not io.all_done.is_set()  # the abort is not handled yet
        await deliver(delta("a", "more tokens"))  # a step already in flight: ignored, still not done
        assert not io.all_done.is_set() and streams["a"].text == "hello "
        await deliver(delta("a", "", finish_reason="stop"))  # the scheduler's acknowledgement
        assert io.all_done.is_set() and io.num_unfinished == 0

    run(script)


def test_stop_string_in_the_last_step_needs_no_abort():
    async def script(io, scheduler, streams, deliver):
        await deliver(delta("a", "hello world", finish_reason="length"), delta("b", "done", finish_reason="length"))
        assert streams["a"].output.finish_reason == "stop" and streams["a"].text == "hello "
        assert scheduler.aborts == []
        assert io.all_done.is_set()

    run(script)
