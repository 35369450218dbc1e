"""The router's ASGI app: KsanaLLM's node routes, ``/health`` and ``/nodes``, and the proxied inference routes.

Starlette, as the server's app: bodies are validated by ``ksana.router.protocol`` and every error (a refused
registration, no pair, an unknown route) is ``{"error": {"message", "type", "param", "code"}}`` with its status.
"""

from __future__ import annotations

import logging

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ksana.router.protocol import HeartbeatRequest, RegisterCommIdRequest, RegisterNodeRequest
from ksana.router.proxy import Proxy
from ksana.router.state import RouterState
from ksana.server.protocol import APIError, parse_body

logger = logging.getLogger(__name__)

_PROXIED_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]


class _ORJSONResponse(JSONResponse):
    def render(self, content) -> bytes:
        return orjson.dumps(content)


def error_response(error: APIError) -> Response:
    return _ORJSONResponse(error.body(), status_code=error.status)


def build_app(state: RouterState, proxy: Proxy) -> Starlette:
    async def register_node(request: Request) -> Response:
        req: RegisterNodeRequest = parse_body(await request.body(), RegisterNodeRequest)
        return _ORJSONResponse(await state.register_node(req), status_code=201)

    async def heartbeat(request: Request) -> Response:
        req: HeartbeatRequest = parse_body(await request.body(), HeartbeatRequest)
        return _ORJSONResponse(await state.heartbeat(req.node_id))

    async def register_comm_id(request: Request) -> Response:
        req: RegisterCommIdRequest = parse_body(await request.body(), RegisterCommIdRequest)
        return _ORJSONResponse(await state.register_comm_id(req))

    async def health(request: Request) -> Response:
        return _ORJSONResponse({"status": "healthy", "routable_pairs": len(proxy.usable_routes())})

    async def nodes(request: Request) -> Response:
        return _ORJSONResponse(await state.nodes())

    routes = [
        Route("/RegisterNode", register_node, methods=["POST"]),
        Route("/Heartbeat", heartbeat, methods=["POST"]),
        Route("/RegisterCommId", register_comm_id, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/nodes", nodes, methods=["GET"]),
        Route("/generate", proxy.endpoint, methods=["POST"]),
        Route("/v1/{path:path}", proxy.endpoint, methods=_PROXIED_METHODS),
        Route("/v2/{path:path}", proxy.endpoint, methods=_PROXIED_METHODS),
    ]

    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        if exc.status >= 500 or exc.status in (403, 404):
            logger.warning("%s %s: %d %s", request.method, request.url.path, exc.status, exc.message)
        return error_response(exc)

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                       code=code))

    async def on_error(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s", request.url.path, exc_info=exc)
        return error_response(APIError(500, "internal server error", code="internal_error"))

    return Starlette(routes=routes, exception_handlers={APIError: on_api_error, HTTPException: on_http_error,
                                                        Exception: on_error})
