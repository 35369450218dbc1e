"""An ASGI response driven by a coroutine that chooses its status late and notices a client that leaves.

Starlette's ``StreamingResponse`` commits the status before the body exists and, when the client disconnects while
a chunk is being sent, leaves the body's generator suspended instead of closing it. Here the producer coroutine
runs next to a task that watches for ``http.disconnect``; a disconnect cancels the producer, whose ``async with``
blocks (the engine requests' group) then abort what is left right away.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import orjson
import trio

from ksana.server.protocol import APIError

logger = logging.getLogger(__name__)


class ResponseWriter:
    """The last send is shielded: when the final body part goes out, hypercorn recycles the connection for the
    next request inside that same ``send`` and delivers ``http.disconnect`` to the app; a cancellation landing
    there would leave the connection neither idle nor closed (and shutdown waiting for it)."""

    def __init__(self, send) -> None:
        self._send = send
        self.started = False
        self.ended = False

    async def start(self, status: int, content_type: str, headers: tuple[tuple[str, str], ...] = ()) -> None:
        raw = [(b"content-type", content_type.encode())] + [(k.encode(), v.encode()) for k, v in headers]
        await self._send({"type": "http.response.start", "status": status, "headers": raw})
        self.started = True

    async def write(self, data: bytes) -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def end(self, data: bytes = b"") -> None:
        if not self.ended:
            self.ended = True
            with trio.CancelScope(shield=True):
                await self._send({"type": "http.response.body", "body": data, "more_body": False})

    async def json(self, obj, status: int = 200) -> None:
        body = orjson.dumps(obj)
        await self.start(status, "application/json", (("content-length", str(len(body))),))
        await self.end(body)

    async def error(self, error: APIError) -> None:
        await self.json(error.body(), status=error.status)


Producer = Callable[[ResponseWriter], Awaitable[None]]


class ProducedResponse:
    """Call ``produce(writer)``; an ``APIError`` before the first byte becomes its error response."""

    def __init__(self, produce: Producer) -> None:
        self.produce = produce

    async def __call__(self, scope, receive, send) -> None:
        writer = ResponseWriter(send)
        disconnected = False

        async def watch_disconnect(cancel_scope: trio.CancelScope) -> None:
            nonlocal disconnected
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    disconnected = True
                    cancel_scope.cancel()
                    return

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_disconnect, nursery.cancel_scope)
            try:
                await self.produce(writer)
            except APIError as exc:
                if writer.started:  # producers render their own in-stream errors; reaching here is a bug
                    logger.error("error after the response started: %s", exc.message)
                else:
                    await writer.error(exc)
            except Exception:
                logger.exception("request handler failed")
                if not writer.started:
                    await writer.error(APIError(500, "internal server error", code="internal_error"))
            finally:
                nursery.cancel_scope.cancel()
        if not disconnected and writer.started:
            await writer.end()
        elif disconnected and not writer.ended:
            logger.info("client disconnected from %s before the response ended", scope.get("path"))
