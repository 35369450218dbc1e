"""OpenAI's /v1/completions, /v1/chat/completions and /v1/models, as vLLM serves them.

SSE streams are ``data: {json}\\n\\n`` events ending with ``data: [DONE]``; with ``stream_options.include_usage``
every chunk carries ``"usage": null`` and a last chunk with no choices carries the usage. An error after the stream
started (the server stopping, a request timing out in the queue) is sent as a final ``data: {"error": ...}`` event
before ``[DONE]``, which the ``openai`` client raises as ``APIError``.
"""

from __future__ import annotations

from typing import Any

import orjson

from ksana.messages import PromptLogprobs
from ksana.sampling_params import SamplingParams
from ksana.server.beam_search import BeamSearchParams
from ksana.server.context import ServerContext
from ksana.server.generation import Choice, ChoiceDelta, Generation, TokenInfo
from ksana.server.io_actor import ServerShuttingDown
from ksana.server.protocol import (
    MAX_LOGPROBS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    OpenAISampling,
    bad_request,
    make_sampling_params,
    parse_body,
    service_unavailable,
)
from ksana.server.responses import ResponseWriter

SSE_HEADERS = (("cache-control", "no-cache"),)
_DONE = b"data: [DONE]\n\n"


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def shutdown_error() -> APIError:
    return service_unavailable("the server is shutting down", code="server_shutting_down")


def models_list(ctx: ServerContext) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(ctx)]}


def model_card(ctx: ServerContext) -> dict[str, Any]:
    return {"id": ctx.served_model_name, "object": "model", "created": ctx.created, "owned_by": "ksana-llm",
            "root": str(ctx.model_dir), "parent": None, "max_model_len": ctx.max_token_len,
            "vocab_size": ctx.vocab_size}


def usage(gen: Generation) -> dict[str, Any]:
    prompt, completion = gen.num_prompt_tokens, gen.num_completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": gen.num_cached_tokens}}


def _beam_params(ctx: ServerContext, req: OpenAISampling, params: SamplingParams,
                 max_tokens: int | None) -> BeamSearchParams | None:
    """``use_beam_search`` with ``n`` as the beam width (vLLM's convention on the OpenAI routes)."""
    if not req.use_beam_search:
        return None
    if params.stop:
        raise bad_request("stop strings are not supported with beam search", param="stop")
    eos = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(ctx.eos_token_ids))
    return BeamSearchParams(beam_width=params.n, max_tokens=max_tokens or (1 << 30), eos_token_ids=eos,
                            length_penalty=req.length_penalty, early_stopping=req.early_stopping,
                            min_tokens=params.min_tokens)


def _check_logprobs(value: int | None, param: str) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise bad_request(f"{param} must be in [0, {MAX_LOGPROBS}], got {value}", param=param)


async def _run(writer: ResponseWriter, gen: Generation, stream: bool, render_chunk, render_final,
               first_chunks=None, include_usage: bool = False) -> None:
    """Admission, then a JSON body or an SSE stream; errors before the first byte become HTTP statuses."""
    async with gen:
        try:
            await gen.start()
        except ServerShuttingDown:
            raise shutdown_error() from None
        if not stream:
            try:
                await gen.run_to_end()
            except ServerShuttingDown:
                raise shutdown_error() from None
            await writer.json(render_final())
            return
        await writer.start(200, "text/event-stream", SSE_HEADERS)
        try:
            for chunk in first_chunks() if first_chunks is not None else ():
                await writer.write(_sse(chunk))
            async for delta in gen.deltas():
                await writer.write(_sse(render_chunk(delta)))
            if include_usage:
                await writer.write(_sse(render_chunk(None)))
        except ServerShuttingDown:
            await writer.write(_sse(shutdown_error().body()))
        except APIError as exc:
            await writer.write(_sse(exc.body()))
        await writer.end(_DONE)


# ---- /v1/completions ------------------------------------------------------------------------------------------
def _completion_prompts(ctx: ServerContext, prompt) -> tuple[list[list[int]], list[str | None]]:
    if isinstance(prompt, str):
        items: list = [prompt]
    elif prompt and isinstance(prompt[0], int):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise bad_request("the prompt is empty", param="prompt")
    token_lists, texts = [], []
    for item in items:
        if isinstance(item, str):
            token_lists.append(ctx.check_prompt(ctx.encode_text(item)))
            texts.append(item)
        else:
            token_lists.append(ctx.check_prompt(list(item)))
            texts.append(None)
    return token_lists, texts


def _prompt_logprobs(ctx: ServerContext, prompt: list[int], logprobs: PromptLogprobs,
                     as_ids: bool) -> dict[str, Any]:
    """The legacy logprobs object of an echoed prompt: its first token has no logprob (``null``, as its top)."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [None], "top_logprobs": [None], "text_offset": []}
    offset = 0
    for token_id in prompt:
        out["tokens"].append(ctx.token_text(token_id, as_ids))
        out["text_offset"].append(offset)
        offset += len(ctx.token_text(token_id)) if ctx.tokenizer is not None else 0
    for i, (logprob, top) in enumerate(zip(logprobs.logprobs, logprobs.top_logprobs, strict=True)):
        text = out["tokens"][logprobs.first_index + i]
        out["token_logprobs"].append(logprob)
        entry = {text: logprob}
        for token_id, top_logprob in top:
            entry.setdefault(ctx.token_text(token_id, as_ids), top_logprob)
        out["top_logprobs"].append(entry)
    return out


def _joined(first: dict[str, Any], then: dict[str, Any] | None) -> dict[str, Any]:
    return {key: first[key] + then[key] for key in first} if then is not None else first


def _completion_logprobs(ctx: ServerContext, tokens: list[TokenInfo], offset: int,
                         as_ids: bool) -> tuple[dict[str, Any], int]:
    """OpenAI's legacy logprobs object for these tokens, and the text offset after them."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token in tokens:
        text = ctx.token_text(token.token_id, as_ids)
        out["tokens"].append(text)
        out["token_logprobs"].append(token.logprob)
        top = {text: token.logprob}
        for token_id, logprob in token.top:
            top.setdefault(ctx.token_text(token_id, as_ids), logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(ctx.token_text(token.token_id)) if ctx.tokenizer is not None else 0
    return out, offset


def _check_request(ctx: ServerContext, req: OpenAISampling) -> None:
    """What both OpenAI routes check before the prompt is read."""
    ctx.check_model(req.model)
    req.check_stream_options()
    ctx.check_stop_token_ids(req.stop_token_ids)


async def completions(ctx: ServerContext, body: bytes, writer: ResponseWriter) -> None:
    req: CompletionRequest = parse_body(body, CompletionRequest)
    _check_request(ctx, req)
    if req.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of must equal n (or be left out)", param="best_of")
    _check_logprobs(req.logprobs, "logprobs")
    prompts, prompt_texts = _completion_prompts(ctx, req.prompt)
    if "max_tokens" in req.model_fields_set:
        max_tokens = req.max_tokens
        for prompt in prompts:
            ctx.check_max_tokens(len(prompt), max_tokens, "max_tokens")
    else:  # OpenAI's 16, or the model's default where that is lower (vLLM takes the smaller)
        max_tokens = min(req.max_tokens, ctx.default_sampling.get("max_tokens", req.max_tokens))
    # echo with logprobs: the prompt's tokens get logprobs too, with as many top alternatives.
    echo_logprobs = req.echo and req.logprobs is not None
    if echo_logprobs and req.use_beam_search:
        raise bad_request("echo with logprobs is not supported with beam search", param="echo")
    params = make_sampling_params(**req.sampling_kwargs(ctx.default_sampling), max_tokens=max_tokens,
                                  logprobs=req.logprobs, prompt_logprobs=req.logprobs if echo_logprobs else None)
    gen = Generation(ctx, ctx.new_id("cmpl"), prompts, params, _beam_params(ctx, req, params, max_tokens))
    head = {"id": gen.request_id, "object": "text_completion", "created": ctx.created, "model": ctx.served_model_name}
    echo = [(text if text is not None else ctx.decode(ids)) if req.echo else "" for ids, text in
            zip(prompts, prompt_texts, strict=True)]
    offsets = [len(echo[c.prompt_index]) for c in gen.choices]

    def choice_logprobs(tokens: list[TokenInfo], index: int) -> dict[str, Any] | None:
        if req.logprobs is None:
            return None
        lp, offsets[index] = _completion_logprobs(ctx, tokens, offsets[index], req.return_tokens_as_token_ids)
        return lp

    def echo_logprobs_of(choice: Choice) -> dict[str, Any]:
        return _prompt_logprobs(ctx, prompts[choice.prompt_index], choice.prompt_logprobs,
                                req.return_tokens_as_token_ids)

    def render_final() -> dict[str, Any]:
        choices = []
        for c in gen.choices:
            logprobs = choice_logprobs(c.tokens, c.index)
            if echo_logprobs:
                logprobs = _joined(echo_logprobs_of(c), logprobs)
            choices.append({"index": c.index, "text": echo[c.prompt_index] + c.text, "logprobs": logprobs,
                            "finish_reason": c.finish_reason})
        return head | {"choices": choices, "usage": usage(gen)}

    def first_chunks():
        if req.echo:
            for c in gen.choices:
                yield head | {"choices": [{"index": c.index, "text": echo[c.prompt_index],
                                           "logprobs": echo_logprobs_of(c) if echo_logprobs else None,
                                           "finish_reason": None}]} | _usage_field(req)

    def render_chunk(delta: ChoiceDelta | None) -> dict[str, Any]:
        if delta is None:
            return head | {"choices": [], "usage": usage(gen)}
        choice = {"index": delta.index, "text": delta.text, "logprobs": choice_logprobs(delta.tokens, delta.index),
                  "finish_reason": delta.finish_reason}
        return head | {"choices": [choice]} | _usage_field(req)

    await _run(writer, gen, req.stream, render_chunk, render_final, first_chunks, req.include_usage)


def _usage_field(req: OpenAISampling) -> dict[str, Any]:
    return {"usage": None} if req.include_usage else {}


# ---- /v1/chat/completions -------------------------------------------------------------------------------------
def _chat_logprobs(ctx: ServerContext, tokens: list[TokenInfo], as_ids: bool) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = ctx.token_text(token_id, as_ids)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = [entry(t.token_id, t.logprob) | {"top_logprobs": [entry(i, lp) for i, lp in t.top]} for t in tokens]
    return {"content": content, "refusal": None}


async def chat_completions(ctx: ServerContext, body: bytes, writer: ResponseWriter) -> None:
    req: ChatCompletionRequest = parse_body(body, ChatCompletionRequest)
    _check_request(ctx, req)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
    _check_logprobs(req.top_logprobs, "top_logprobs")
    prompt = ctx.check_prompt(
        ctx.apply_chat_template(req.messages, req.add_generation_prompt, req.chat_template_kwargs), param="messages")
    if req.max_completion_tokens is not None:
        max_tokens = req.max_completion_tokens
        ctx.check_max_tokens(len(prompt), max_tokens, "max_completion_tokens")
    elif req.max_tokens is not None:
        max_tokens = req.max_tokens
        ctx.check_max_tokens(len(prompt), max_tokens, "max_tokens")
    else:  # the model's default, else as many as the context holds
        max_tokens = ctx.default_sampling.get("max_tokens")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = make_sampling_params(**req.sampling_kwargs(ctx.default_sampling), max_tokens=max_tokens,
                                  logprobs=logprobs)
    gen = Generation(ctx, ctx.new_id("chatcmpl"), [prompt], params, _beam_params(ctx, req, params, max_tokens))
    head = {"id": gen.request_id, "created": ctx.created, "model": ctx.served_model_name}

    def render_final() -> dict[str, Any]:
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": (_chat_logprobs(ctx, c.tokens, req.return_tokens_as_token_ids)
                                 if req.logprobs else None),
                    "finish_reason": c.finish_reason} for c in gen.choices]
        return head | {"object": "chat.completion", "choices": choices, "usage": usage(gen)}

    def first_chunks():
        for c in gen.choices:
            choice = {"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}
            yield head | {"object": "chat.completion.chunk", "choices": [choice]} | _usage_field(req)

    def render_chunk(delta: ChoiceDelta | None) -> dict[str, Any]:
        if delta is None:
            return head | {"object": "chat.completion.chunk", "choices": [], "usage": usage(gen)}
        choice = {"index": delta.index, "delta": {"content": delta.text} if delta.text else {},
                  "logprobs": (_chat_logprobs(ctx, delta.tokens, req.return_tokens_as_token_ids)
                               if req.logprobs else None),
                  "finish_reason": delta.finish_reason}
        return head | {"object": "chat.completion.chunk", "choices": [choice]} | _usage_field(req)

    await _run(writer, gen, req.stream, render_chunk, render_final, first_chunks, req.include_usage)
