"""One HTTP request's generation, whatever the route: fan-out, admission, text, stop strings, beam search.

The routes differ only in how they render ``ChoiceDelta``s. A ``Generation`` submits its engine requests (``n``
per prompt, ids ``"{id}-{prompt}-{i}"``, seeds ``seed + i`` as in ``LLM``), then ``start()`` waits until the
scheduler has answered every one of them once (a first token, or a rejection), so a full queue or a bad prompt
still becomes an HTTP error status rather than a broken stream. ``deltas()`` then yields each choice's new text and
tokens as steps come. Beam search runs whole inside ``start()`` and yields each returned beam once. Prompt
logprobs, when the parameters ask, come with a request's first token, so ``start()`` has them on every choice.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import attrs

from ksana.messages import PromptLogprobs, RequestDelta
from ksana.output_processor import SequenceStream
from ksana.request import InferRequest
from ksana.sampling_params import SamplingParams
from ksana.server.beam_search import BeamSearchParams, beam_search
from ksana.server.context import ServerContext
from ksana.server.disagg import KV_TRANSFER, pair_params
from ksana.server.io_actor import RequestGroup
from ksana.server.protocol import APIError, bad_request, engine_error


@attrs.frozen
class TokenInfo:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the top alternatives, best first (when logprobs were asked)


@attrs.define
class ChoiceDelta:
    index: int
    text: str
    tokens: list[TokenInfo]
    finish_reason: str | None = None


@attrs.define(eq=False)
class Choice:
    """One returned sequence, accumulated."""

    index: int
    prompt_index: int
    request_id: str = ""
    stream: SequenceStream | None = None
    text: str = ""
    tokens: list[TokenInfo] = attrs.field(factory=list)
    finish_reason: str | None = None
    score: float | None = None  # beam search: the length-penalised score
    num_cached_tokens: int = 0
    seen: bool = False  # the scheduler answered at least once
    prompt_logprobs: PromptLogprobs | None = None  # with the first token, when the parameters asked

    @property
    def token_ids(self) -> list[int]:
        return [t.token_id for t in self.tokens]


class Generation:
    """``async with Generation(...) as gen: await gen.start(); async for d in gen.deltas(): ...``"""

    def __init__(self, ctx: ServerContext, request_id: str, prompts: list[list[int]], params: SamplingParams,
                 beam: BeamSearchParams | None = None) -> None:
        if params.stop and ctx.tokenizer is None:
            raise bad_request("stop strings need a tokenizer; this model has none (use stop_token_ids)", param="stop")
        self.ctx = ctx
        self.request_id = request_id
        self.prompts = prompts
        self.params = params
        self.beam = beam
        n = beam.num_returned if beam is not None else params.n
        self.choices = [Choice(index=p * n + i, prompt_index=p) for p in range(len(prompts)) for i in range(n)]
        self._by_request: dict[str, Choice] = {}
        self._group: RequestGroup | None = None
        self._pending: list[RequestDelta] = []
        self._num_beam_steps = 0
        self._held: dict[int, ChoiceDelta] = {}  # by choice index: merged, not yet yielded
        self._streamed: set[int] = set()  # choices that have yielded tokens

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(self, *exc_info) -> None:
        if self._group is not None:
            await self._group.aclose()

    # ---- usage ------------------------------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.choices)

    @property
    def num_cached_tokens(self) -> int:
        per_prompt: dict[int, int] = {}
        for c in self.choices:
            per_prompt[c.prompt_index] = max(per_prompt.get(c.prompt_index, 0), c.num_cached_tokens)
        return sum(per_prompt.values())

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    # ---- running ----------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Submit, and return once every request is admitted; raises ``APIError`` on a rejection."""
        if self.beam is not None:
            kv = KV_TRANSFER.get()
            if kv is not None:
                pair_params(kv, self.params, len(self.choices), beam=True)
            await self._run_beam_search()
            return
        params = self.params
        kv = KV_TRANSFER.get()
        if kv is not None:
            params = pair_params(kv, params, len(self.choices), beam=False)
        base_seed = params.seed if params.seed is not None else self.ctx.new_seed()
        requests = []
        for choice in self.choices:
            i = choice.index % params.n
            choice.request_id = f"{self.request_id}-{choice.prompt_index}-{i}"
            choice.stream = SequenceStream.create(choice.index, self.ctx.tokenizer, self.prompts[choice.prompt_index],
                                                  params, self.ctx.skip_special_tokens)
            self._by_request[choice.request_id] = choice
            requests.append(InferRequest(
                request_id=choice.request_id,
                prompt_token_ids=self.prompts[choice.prompt_index],
                sampling_params=params,
                seed=base_seed + i,
                eos_token_ids=self.ctx.eos_token_ids,
                kv_transfer=kv,
            ))
        self._group = await self.ctx.io.submit(requests)
        while not all(c.seen for c in self.choices):
            delta = await self._group.receive()
            choice = self._by_request[delta.request_id]
            choice.seen = True
            if delta.error is not None:
                raise engine_error(delta.error)
            if delta.prompt_logprobs is not None:
                choice.prompt_logprobs = delta.prompt_logprobs
            self._pending.append(delta)

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Each choice's new visible text and tokens; ends when every choice finished.

        Deltas that piled up while the handler was busy are merged per choice, so a response that falls behind
        the step loop catches up with one write instead of one per step. With ``ctx.stream_interval`` N > 1,
        after a choice's first token (sent at once: time to first token is what clients watch) its tokens wait
        until it has N new ones or finishes, because every event costs a pass through the HTTP stack.
        """
        if self.beam is not None:
            for choice in self.choices:
                yield ChoiceDelta(choice.index, choice.text, list(choice.tokens), choice.finish_reason)
            return
        assert self._group is not None, "start() first"
        while not self.finished:
            batch, self._pending = self._pending, []
            if not batch:
                batch.append(await self._group.receive())
            batch.extend(self._group.receive_ready())
            for delta in batch:
                out = await self._apply(delta)
                if out is None:
                    continue
                held = self._held.get(out.index)
                if held is None:
                    self._held[out.index] = out
                else:
                    held.text += out.text
                    held.tokens.extend(out.tokens)
                    held.finish_reason = out.finish_reason
            for out in self._ready(self.finished):
                yield out

    def _ready(self, flush: bool) -> list[ChoiceDelta]:
        """The held deltas due out: all of them when ``flush`` or streaming token by token; else a choice's
        first tokens, and deltas with ``stream_interval`` tokens or a finish."""
        interval = self.ctx.stream_interval
        flush = flush or interval <= 1
        due = [d for d in self._held.values() if flush or d.finish_reason is not None or len(d.tokens) >= interval
               or (bool(d.tokens) and d.index not in self._streamed)]
        for d in due:
            del self._held[d.index]
            if d.tokens:
                self._streamed.add(d.index)
        return due

    async def run_to_end(self) -> list[Choice]:
        async for _ in self.deltas():
            pass
        return self.choices

    async def _apply(self, delta: RequestDelta) -> ChoiceDelta | None:
        choice = self._by_request.get(delta.request_id)
        if choice is None or choice.finish_reason is not None:
            return None  # a stop string already ended it; this is the scheduler's acknowledgement
        if delta.error is not None:
            raise engine_error(delta.error)
        stream = choice.stream
        num_before = len(stream.output.token_ids)
        text, stopped = stream.feed(delta)
        num_new = len(stream.output.token_ids) - num_before
        tokens = [TokenInfo(t, lp, tuple(top or ()))
                  for t, lp, top in zip(delta.new_token_ids[:num_new], delta.new_logprobs[:num_new],
                                        _pad(delta.new_top_logprobs, num_new), strict=True)]
        choice.tokens.extend(tokens)
        choice.text += text
        choice.num_cached_tokens = max(choice.num_cached_tokens, delta.num_cached_tokens)
        if stopped:
            await self._group.abort(delta.request_id, reason="stop")
        if stream.output.finished:
            if stream.output.finish_reason == "abort":  # only this handler aborts its requests; never expected
                raise APIError(500, f"request {delta.request_id} was aborted by the engine", code="aborted")
            choice.finish_reason = stream.output.finish_reason
        if not text and not tokens and choice.finish_reason is None:
            return None
        return ChoiceDelta(choice.index, text, tokens, choice.finish_reason)

    # ---- beam search ------------------------------------------------------------------------------------------
    async def _run_beam_search(self) -> None:
        beam = self.beam
        n = beam.num_returned
        for p, prompt in enumerate(self.prompts):
            limit = self.ctx.max_token_len - len(prompt)
            params = attrs.evolve(beam, max_tokens=min(beam.max_tokens, limit))

            async def expand(beams, num_top, prompt=prompt, p=p):
                return await self._expand(p, prompt, beams, num_top)

            hypotheses = await beam_search(params, expand)
            for i, hyp in enumerate(hypotheses):
                choice = self.choices[p * n + i]
                top_n = self.params.logprobs or 0
                choice.tokens = [TokenInfo(t, lp, tuple(top[:top_n]))
                                 for t, lp, top in zip(hyp.beam.token_ids, hyp.beam.logprobs, hyp.beam.top_logprobs,
                                                       strict=True)]
                choice.text = self.ctx.decode(list(hyp.token_ids))
                choice.finish_reason = hyp.finish_reason
                choice.score = hyp.score

    async def _expand(self, p: int, prompt: list[int], beams: list[tuple[int, ...]],
                      num_top: int) -> list[list[tuple[int, float]]]:
        """Each beam's next-token top logprobs: one greedy 1-token request per beam, run as one batch."""
        step = self._num_beam_steps
        self._num_beam_steps += 1
        params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=num_top, ignore_eos=True)
        requests = [InferRequest(request_id=f"{self.request_id}-{p}-s{step}-b{b}",
                                 prompt_token_ids=prompt + list(tokens), sampling_params=params, seed=0)
                    for b, tokens in enumerate(beams)]
        tops: dict[str, list[tuple[int, float]]] = {}
        async with await self.ctx.io.submit(requests, internal=True) as group:
            while len(tops) < len(requests):
                delta = await group.receive()
                if delta.error is not None:
                    raise engine_error(delta.error)
                if not delta.new_token_ids:
                    raise APIError(500, f"beam step {delta.request_id} ended without a token", code="aborted")
                tops[delta.request_id] = [(int(t), float(lp)) for t, lp in delta.new_top_logprobs[0]]
        return [tops[r.request_id] for r in requests]


def _pad(items: tuple, n: int) -> list:
    items = list(items[:n])
    return items + [None] * (n - len(items))
