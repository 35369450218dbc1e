"""KsanaLLM's native ``POST /generate``.

Input: ``prompt`` (text) or ``input_tokens`` (ids; they win when both are given), ``sampling_config`` with
KsanaLLM's keys, ``stream`` (default true). Output: ``{"texts", "output_token_ids", "logprobs",
"input_token_ids"}``, one entry per returned sequence (plus ``"scores"`` under beam search). A stream sends the same
object **cumulatively** (all tokens so far, the text re-decoded) each time the token count changes, each chunk ended
by a NUL byte; an error after the stream started is a last ``{"error": {...}}`` chunk.

KsanaLLM's sampling rules: greedy unless ``do_sample`` is true or ``topk`` > 1 (``topk`` defaults to 1, or to no
cut when ``do_sample`` is true); ``topp`` 0 and ``temperature`` 0 mean 1 (off); ``max_new_tokens`` -1 means no limit
but the model's length; ``num_beams`` > 1 is beam search returning ``num_return_sequences`` beams; otherwise
``num_return_sequences`` > 1 samples that many sequences in parallel.
"""

from __future__ import annotations

from typing import Any

import orjson

from ksana.server.beam_search import BeamSearchParams
from ksana.server.context import ServerContext
from ksana.server.generation import Choice, Generation
from ksana.server.io_actor import ServerShuttingDown
from ksana.server.openai_api import shutdown_error
from ksana.server.protocol import APIError, GenerateRequest, bad_request, make_sampling_params, parse_body
from ksana.server.responses import ResponseWriter


def _sampling(req: GenerateRequest):
    cfg = req.sampling_config
    if cfg.no_repeat_ngram_size:
        raise bad_request("no_repeat_ngram_size is not supported", param="sampling_config")
    if cfg.topk is not None and cfg.topk < 1:
        raise bad_request(f"sampling_config.topk must be at least 1, got {cfg.topk}", param="sampling_config")
    greedy = cfg.do_sample is False or (cfg.topk if cfg.topk is not None else (0 if cfg.do_sample else 1)) == 1
    top_k = cfg.topk if cfg.topk is not None else 0
    num_beams, num_return = cfg.num_beams, cfg.num_return_sequences
    if num_beams < 1:
        raise bad_request(f"sampling_config.num_beams must be at least 1, got {num_beams}", param="sampling_config")
    if num_beams > 1 and not 1 <= num_return <= num_beams:
        raise bad_request(f"sampling_config.num_return_sequences must be in [1, num_beams={num_beams}], got "
                          f"{num_return}", param="sampling_config")
    params = make_sampling_params(
        n=num_return if num_beams == 1 else num_beams,
        temperature=0.0 if greedy else (cfg.temperature or 1.0),
        top_p=cfg.topp or 1.0,
        top_k=top_k,
        repetition_penalty=cfg.repetition_penalty,
        max_tokens=None if cfg.max_new_tokens == -1 else cfg.max_new_tokens,
        min_tokens=cfg.min_tokens,
        stop=cfg.stop_strings,
        stop_token_ids=cfg.stop_token_ids,
        ignore_eos=cfg.ignore_eos,
        logprobs=cfg.logprobs or None,
        seed=cfg.seed,
    )
    return params, num_beams, num_return


async def generate(ctx: ServerContext, body: bytes, writer: ResponseWriter) -> None:
    req: GenerateRequest = parse_body(body, GenerateRequest)
    if req.input_tokens is not None:
        prompt = ctx.check_prompt(list(req.input_tokens), param="input_tokens")
    elif req.prompt is not None:
        prompt = ctx.check_prompt(ctx.encode_text(req.prompt))
    else:
        raise bad_request("give a prompt or input_tokens", param="prompt")
    ctx.check_stop_token_ids(req.sampling_config.stop_token_ids, param="sampling_config")
    params, num_beams, num_return = _sampling(req)
    beam = None
    if num_beams > 1:
        if params.stop:
            raise bad_request("stop_strings are not supported with beam search", param="sampling_config")
        eos = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(ctx.eos_token_ids))
        cfg = req.sampling_config
        beam = BeamSearchParams(beam_width=num_beams, max_tokens=params.max_tokens or (1 << 30), eos_token_ids=eos,
                                length_penalty=cfg.length_penalty, early_stopping=cfg.early_stopping,
                                min_tokens=params.min_tokens, num_return_sequences=num_return)
    gen = Generation(ctx, ctx.new_id("generate"), [prompt], params, beam)

    def result() -> dict[str, Any]:
        out = {
            "texts": [c.text for c in gen.choices],
            "output_token_ids": [c.token_ids for c in gen.choices],
            "logprobs": [_logprobs(c) for c in gen.choices] if params.logprobs else None,
            "input_token_ids": prompt,
        }
        if beam is not None:
            out["scores"] = [c.score for c in gen.choices]
        return out

    async with gen:
        try:
            await gen.start()
            if not req.stream:
                await gen.run_to_end()
                await writer.json(result())
                return
        except ServerShuttingDown:
            raise shutdown_error() from None
        await writer.start(200, "application/octet-stream")
        num_sent = -1
        try:
            async for _ in gen.deltas():
                num_tokens = gen.num_completion_tokens
                if num_tokens != num_sent:
                    num_sent = num_tokens
                    await writer.write(orjson.dumps(result()) + b"\0")
            if num_sent == -1:
                await writer.write(orjson.dumps(result()) + b"\0")
        except ServerShuttingDown:
            await writer.write(orjson.dumps(shutdown_error().body()) + b"\0")
        except APIError as exc:
            await writer.write(orjson.dumps(exc.body()) + b"\0")


def _logprobs(choice: Choice) -> list[list[list[float]]]:
    """Per token: ``[token_id, logprob]`` of the chosen token, then of the top alternatives."""
    return [[[t.token_id, t.logprob]] + [[i, lp] for i, lp in t.top] for t in choice.tokens]
