"""The ASGI app: routes, the API key check and OpenAI-form errors for everything that goes wrong.

Starlette (FastAPI's core) without FastAPI's request models: bodies are validated by ``protocol`` so that every
error, including malformed JSON and unknown routes, has OpenAI's shape and status.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from functools import partial

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ksana.events import LoopStoppedError
from ksana.server import generate_api, openai_api
from ksana.server.context import ServerContext
from ksana.server.disagg import KV_TRANSFER, kv_transfer_from_headers
from ksana.server.errors import ORJSONResponse, error_handlers, error_response
from ksana.server.metrics import CONTENT_TYPE
from ksana.server.protocol import (
    APIError,
    DetokenizeRequest,
    TokenizeRequest,
    bad_request,
    check_content_type,
    parse_body,
)
from ksana.server.responses import ProducedResponse, ResponseWriter

logger = logging.getLogger(__name__)

_PUBLIC_PATHS = ("/health", "/metrics")

Handler = Callable[[ServerContext, bytes, ResponseWriter], Awaitable[None]]


def build_app(ctx: ServerContext) -> Starlette:
    def generation_route(handler: Handler):
        async def endpoint(request: Request) -> ProducedResponse:
            KV_TRANSFER.set(kv_transfer_from_headers(request.headers, ctx.node_role))
            check_content_type(request.headers.get("content-type"))
            body = await request.body()
            return ProducedResponse(partial(handler, ctx, body))

        return endpoint

    async def health(request: Request) -> Response:
        if ctx.io.is_shutting_down:
            return ORJSONResponse({"status": "shutting down"}, status_code=503)
        return ORJSONResponse({"status": "healthy"})

    async def metrics(request: Request) -> Response:
        if ctx.kv_connector is not None:
            ctx.metrics.set_kv_transfer_stats(ctx.kv_connector)
        try:
            await ctx.io.cache_stats()
        except LoopStoppedError:
            pass  # shutting down: the cache gauges keep their last values
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)

    async def models(request: Request) -> Response:
        return ORJSONResponse(openai_api.models_list(ctx))

    async def model(request: Request) -> Response:
        name = request.path_params["model"]
        ctx.check_model(name)
        return ORJSONResponse(openai_api.model_card(ctx))

    async def tokenize(request: Request) -> Response:
        check_content_type(request.headers.get("content-type"))
        req: TokenizeRequest = parse_body(await request.body(), TokenizeRequest)
        ctx.check_model(req.model)
        if req.messages is not None:
            tokens = ctx.apply_chat_template(req.messages, req.add_generation_prompt)
        elif req.prompt is not None:
            tokens = ctx.encode_text(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            raise bad_request("give a prompt or messages", param="prompt")
        return ORJSONResponse({"count": len(tokens), "max_model_len": ctx.max_token_len, "tokens": tokens})

    async def detokenize(request: Request) -> Response:
        check_content_type(request.headers.get("content-type"))
        req: DetokenizeRequest = parse_body(await request.body(), DetokenizeRequest)
        ctx.check_model(req.model)
        bad = next((t for t in req.tokens if not 0 <= t < ctx.vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {ctx.vocab_size})", param="tokens")
        if ctx.tokenizer is None:
            raise bad_request("this model has no tokenizer", param="tokens")
        return ORJSONResponse({"prompt": ctx.tokenizer.decode(req.tokens)})

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/models", models, methods=["GET"]),  # KsanaLLM's adapter serves these without /v1
        Route("/models/{model:path}", model, methods=["GET"]),
        Route("/v1/completions", generation_route(openai_api.completions), methods=["POST"]),
        Route("/v1/chat/completions", generation_route(openai_api.chat_completions), methods=["POST"]),
        Route("/generate", generation_route(generate_api.generate), methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
    ]

    app = Starlette(routes=routes, exception_handlers=error_handlers(logger))
    return ApiKeyCheck(app, ctx.api_key) if ctx.api_key else app


class ApiKeyCheck:
    """ASGI wrapper: every route but /health and /metrics needs ``Authorization: Bearer <key>``."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in _PUBLIC_PATHS:
            headers = dict(scope["headers"])
            auth = headers.get(b"authorization", b"")
            token = auth[7:] if auth[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
            if not hmac.compare_digest(token, self.api_key):
                error = APIError(401, "Incorrect or missing API key" if token else "Missing API key (send "
                                 "'Authorization: Bearer <key>')", code="invalid_api_key")
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)
