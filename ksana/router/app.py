"""The router's ASGI app: KsanaLLM's node routes, ``/health`` and ``/nodes``, and the proxied inference routes.

Starlette, as the server's app: bodies are validated by ``ksana.router.protocol`` and every error (a refused
registration, no pair, an unknown route) is ``{"error": {"message", "type", "param", "code"}}`` with its status.
"""

from __future__ import annotations

import logging

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ksana.router.protocol import HeartbeatRequest, RegisterCommIdRequest, RegisterNodeRequest
from ksana.router.proxy import Proxy
from ksana.router.state import RouterState
from ksana.server.errors import ORJSONResponse, error_handlers
from ksana.server.protocol import parse_body

logger = logging.getLogger(__name__)

_PROXIED_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]



def build_app(state: RouterState, proxy: Proxy) -> Starlette:
    async def register_node(request: Request) -> Response:
        req: RegisterNodeRequest = parse_body(await request.body(), RegisterNodeRequest)
        return ORJSONResponse(await state.register_node(req), status_code=201)

    async def heartbeat(request: Request) -> Response:
        req: HeartbeatRequest = parse_body(await request.body(), HeartbeatRequest)
        return ORJSONResponse(await state.heartbeat(req.node_id))

    async def register_comm_id(request: Request) -> Response:
        req: RegisterCommIdRequest = parse_body(await request.body(), RegisterCommIdRequest)
        return ORJSONResponse(await state.register_comm_id(req))

    async def health(request: Request) -> Response:
        return ORJSONResponse({"status": "healthy", "routable_pairs": len(proxy.usable_routes())})

    async def nodes(request: Request) -> Response:
        return ORJSONResponse(await state.nodes())

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

    # A refused or unknown node, and the proxy's own failures, are worth a line in the router's log.
    return Starlette(routes=routes, exception_handlers=error_handlers(
        logger, log_when=lambda status: status >= 500 or status in (403, 404)))
