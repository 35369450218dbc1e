"""JSON answers and OpenAI-form errors, shared by the server's app and the router's.

Every error, an ``APIError`` a handler raises, an unknown route or method, or a bug, leaves as
``{"error": {"message", "type", "param", "code"}}`` with its status, never as Starlette's plain text.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import orjson
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ksana.server.protocol import APIError


class ORJSONResponse(JSONResponse):
    def render(self, content) -> bytes:
        return orjson.dumps(content)


def error_response(error: APIError) -> Response:
    return ORJSONResponse(error.body(), status_code=error.status)


def error_handlers(logger: logging.Logger, log_when: Callable[[int], bool] | None = None) -> dict:
    """Starlette's ``exception_handlers``; an ``APIError`` whose status ``log_when`` accepts is logged."""

    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        if log_when is not None and log_when(exc.status):
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

    return {APIError: on_api_error, HTTPException: on_http_error, Exception: on_error}
