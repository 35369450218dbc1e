"""Sends each request to a prefill node and a decode node at once and merges their answers into one.

Both nodes get the client's body and headers (less the hop-by-hop ones) plus KsanaLLM's two coordination headers:
``kv-comm-group-key: <prefill_addr>__<decode_addr>`` and ``kv-comm-request-id``, a positive 31-bit id (``crc32`` of
``"<pid>:<counter>"``, the counter starting at 110, never 0) that tells the two nodes' halves of one request apart.
``x-remote-ip`` carries the client's address unless the client sent one.

The answer, once both nodes' response heads are in:
- the prefill node answered an error status: that error (a bad body is refused by both; the prefill node's word
  comes first);
- ``/generate`` streamed: the prefill node's first NUL-terminated chunk, unless the decode node has already sent
  output, then the decode node's stream;
- any other stream (``/v1/*``, ``/v2/*``): the decode node's stream as it is (SSE with its content type, so OpenAI
  clients work through the router);
- not streamed (the answer has a ``Content-Length``): the decode node's status and body.

The prefill node's response is read to its end in every case (a node may keep it open until its KV has gone out,
and closing it would abort the request there), for at most ``prefill_drain_timeout_s`` after the client's response
ends. A client that leaves closes both upstream requests, so both nodes abort. A node that fails mid-stream ends
the client's stream with an error chunk in the stream's own form (``{"error": ...}\\0``, or an SSE ``data:`` event and
``data: [DONE]``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import zlib
from collections.abc import Callable

import attrs
import httpx2
import orjson
import trio
from starlette.requests import Request

from ksana.router.policy import InFlight, Policy, usable
from ksana.router.protocol import KV_COMM_GROUP_KEY, KV_COMM_REQUEST_ID, REMOTE_IP
from ksana.router.registry import Route
from ksana.router.state import RouterState
from ksana.server.protocol import APIError
from ksana.server.responses import ResponseWriter

logger = logging.getLogger(__name__)

DELIM = b"\0"
# Headers that describe one connection, not the request: the router's own connections set their own.
_HOP_BY_HOP = frozenset({"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "trailer",
                         "upgrade", "proxy-authorization", "proxy-connection", "accept-encoding"})
_NOT_PASSED_BACK = frozenset({"content-type", "content-length", "transfer-encoding", "connection", "keep-alive",
                              "date", "server"})


def make_request_id(pid: int, counter: int) -> int:
    return zlib.crc32(f"{pid}:{counter}".encode()) & 0x7FFFFFFF


@attrs.define
class RequestIds:
    """KsanaLLM's ``kv-comm-request-id`` sequence for this process."""

    pid: int = attrs.field(factory=os.getpid)
    counter: int = 110

    def next(self) -> int:
        while True:
            value = make_request_id(self.pid, self.counter)
            self.counter += 1
            if value:
                return value


@attrs.define(eq=False)
class Proxy:
    client: httpx2.AsyncClient
    state: RouterState
    policy: Policy
    in_flight: InFlight = attrs.field(factory=InFlight)
    ids: RequestIds = attrs.field(factory=RequestIds)
    clock: Callable[[], float] = time.time
    prefill_drain_timeout_s: float = 60.0

    def usable_routes(self) -> list[Route]:
        return usable(self.state.routes, self.clock())

    def choose(self) -> Route:
        routes = self.usable_routes()
        if not routes:
            raise APIError(503, "no prefill/decode pair is available: no active pair has both rank-0 nodes online "
                                "(see GET /nodes)", code="no_available_pair")
        return self.policy.choose(routes, self.in_flight)

    async def endpoint(self, request: Request) -> ProxyResponse:
        body = await request.body()
        route = self.choose()
        request_id = self.ids.next()
        headers = [(name, value) for name, value in request.headers.raw
                   if name.decode("latin-1").lower() not in _HOP_BY_HOP | {KV_COMM_GROUP_KEY, KV_COMM_REQUEST_ID}]
        if REMOTE_IP not in request.headers and request.client is not None:
            headers.append((REMOTE_IP.encode(), request.client.host.encode()))
        headers += [(KV_COMM_GROUP_KEY.encode(), route.comm_key.encode()),
                    (KV_COMM_REQUEST_ID.encode(), str(request_id).encode())]
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        logger.debug("request %d %s %s -> %s", request_id, request.method, target, route.comm_key)
        return ProxyResponse(self, route, request_id, request.method, target, headers, body)


@attrs.define(eq=False)
class _Upstream:
    """One node's side of an exchange; its in-flight count ends once, when it is read out or closed."""

    side: str
    addr: str
    in_flight: InFlight
    response: httpx2.Response | None = None
    finished: bool = False

    def __attrs_post_init__(self) -> None:
        self.in_flight.begin(self.addr)

    def finish(self) -> None:
        if not self.finished:
            self.finished = True
            self.in_flight.end(self.addr)

    @property
    def is_streamed(self) -> bool:
        return "content-length" not in self.response.headers

    @property
    def content_type(self) -> str:
        return self.response.headers.get("content-type", "application/octet-stream")

    def headers_back(self) -> tuple[tuple[str, str], ...]:
        return tuple((k, v) for k, v in self.response.headers.items() if k.lower() not in _NOT_PASSED_BACK)

    async def close(self) -> None:
        self.finish()
        if self.response is not None:
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                await self.response.aclose()


class ProxyResponse:
    """The ASGI response of one proxied request (see the module's docstring for the rules)."""

    def __init__(self, proxy: Proxy, route: Route, request_id: int, method: str, target: str,
                 headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.proxy = proxy
        self.route = route
        self.request_id = request_id
        self.method = method
        self.target = target
        self.headers = headers
        self.body = body
        self._lock = trio.Lock()  # one writer at a time: the prefill chunk never lands inside a decode chunk
        self._decode_started = False
        self._ended = False
        self._client_gone = False
        self._tail = b""  # the last bytes the client got, to close a cut chunk before an error chunk

    async def __call__(self, scope, receive, send) -> None:
        writer = ResponseWriter(send)
        async with contextlib.AsyncExitStack() as upstreams:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_disconnect, receive, nursery.cancel_scope)
                try:
                    await self._exchange(nursery, upstreams, writer)
                except APIError as exc:
                    if writer.started:
                        logger.error("request %d: %s", self.request_id, exc.message)
                    else:
                        await writer.error(exc)
                except Exception:
                    logger.exception("request %d failed", self.request_id)
                    if not writer.started:
                        await writer.error(APIError(500, "internal server error", code="internal_error"))
                finally:
                    self._ended = True
                    if writer.started and not self._client_gone:
                        await writer.end()
                    nursery.cancel_scope.cancel()

    async def _watch_disconnect(self, receive, cancel_scope: trio.CancelScope) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if not self._ended:
                    logger.info("request %d: the client left; closing both upstream requests", self.request_id)
                    self._client_gone = True
                    cancel_scope.cancel()
                return

    async def _exchange(self, nursery: trio.Nursery, upstreams: contextlib.AsyncExitStack,
                        writer: ResponseWriter) -> None:
        prefill, decode = await self._open(upstreams)
        prefill_done = trio.Event()
        if prefill.response.status_code >= 400:
            await self._answer_whole(prefill, writer)
            return
        merge = self.target.split("?", 1)[0] == "/generate" and decode.is_streamed
        if merge and decode.response.status_code < 400:
            await writer.start(decode.response.status_code, decode.content_type, decode.headers_back())
            nursery.start_soon(self._prefill_first_chunk, prefill, writer, prefill_done)
            await self._relay(decode, writer)
        else:
            nursery.start_soon(self._drain, prefill, prefill_done)
            if decode.is_streamed:
                await writer.start(decode.response.status_code, decode.content_type, decode.headers_back())
                await self._relay(decode, writer)
            else:
                await self._answer_whole(decode, writer)
        async with self._lock:
            self._ended = True
        await writer.end()
        with trio.move_on_after(self.proxy.prefill_drain_timeout_s):
            await prefill_done.wait()
        if not prefill_done.is_set():
            logger.warning("request %d: the prefill node %s still answers %g s after the decode node; closing it",
                           self.request_id, prefill.addr, self.proxy.prefill_drain_timeout_s)

    async def _open(self, upstreams: contextlib.AsyncExitStack) -> tuple[_Upstream, _Upstream]:
        """Send the request to both nodes at once; both response heads, or a 502 naming the node that failed."""
        sides = {"prefill": self.route.prefill_addr, "decode": self.route.decode_addr}
        opened = {side: _Upstream(side, addr, self.proxy.in_flight) for side, addr in sides.items()}
        failures: dict[str, Exception] = {}
        for upstream in opened.values():
            upstreams.push_async_callback(upstream.close)

        async def open_one(upstream: _Upstream) -> None:
            client = self.proxy.client
            request = client.build_request(self.method, f"http://{upstream.addr}{self.target}", headers=self.headers,
                                           content=self.body)
            try:
                upstream.response = await client.send(request, stream=True)
            except httpx2.HTTPError as exc:
                failures[upstream.side] = exc
                nursery.cancel_scope.cancel()  # no answer can be merged: stop waiting for the other node

        async with trio.open_nursery() as nursery:
            for upstream in opened.values():
                nursery.start_soon(open_one, upstream)
        for side, exc in failures.items():
            raise APIError(502, f"the {side} node {sides[side]} did not answer: {type(exc).__name__}: {exc}",
                           code="upstream_unreachable")
        return opened["prefill"], opened["decode"]

    async def _answer_whole(self, upstream: _Upstream, writer: ResponseWriter) -> None:
        try:
            body = await upstream.response.aread()
        except httpx2.HTTPError as exc:
            raise APIError(502, f"the {upstream.side} node {upstream.addr} failed mid-answer: {exc}",
                           code="upstream_failed") from None
        finally:
            upstream.finish()
        headers = upstream.headers_back() + (("content-length", str(len(body))),)
        await writer.start(upstream.response.status_code, upstream.content_type, headers)
        self._ended = True  # the client's connection is recycled inside the last send: that is no disconnect
        await writer.end(body)

    async def _relay(self, decode: _Upstream, writer: ResponseWriter) -> None:
        try:
            async for data in decode.response.aiter_raw():
                if data:
                    async with self._lock:
                        self._decode_started = True
                        await self._write(writer, data)
        except httpx2.HTTPError as exc:
            logger.warning("request %d: the decode node %s failed mid-stream: %s", self.request_id, decode.addr, exc)
            error = APIError(502, f"the decode node {decode.addr} failed mid-stream: {type(exc).__name__}",
                             code="upstream_failed")
            async with self._lock:
                await self._write_error(writer, decode.content_type, error)
        finally:
            decode.finish()

    async def _prefill_first_chunk(self, prefill: _Upstream, writer: ResponseWriter, done: trio.Event) -> None:
        """Forward the prefill node's first NUL-terminated chunk unless the decode node spoke first; read the rest."""
        buffer, seen_first = b"", False
        try:
            async for data in prefill.response.aiter_raw():
                if seen_first:
                    continue
                buffer += data
                end = buffer.find(DELIM)
                if end < 0:
                    continue
                chunk, seen_first = buffer[:end + 1], True
                async with self._lock:
                    if not self._decode_started and not self._ended:
                        await self._write(writer, chunk)
        except httpx2.HTTPError as exc:
            logger.warning("request %d: the prefill node %s failed mid-stream: %s", self.request_id, prefill.addr, exc)
        finally:
            prefill.finish()
            done.set()

    async def _drain(self, prefill: _Upstream, done: trio.Event) -> None:
        try:
            async for _ in prefill.response.aiter_raw():
                pass
        except httpx2.HTTPError as exc:
            logger.warning("request %d: the prefill node %s failed mid-answer: %s", self.request_id, prefill.addr, exc)
        finally:
            prefill.finish()
            done.set()

    async def _write(self, writer: ResponseWriter, data: bytes) -> None:
        await writer.write(data)
        self._tail = (self._tail + data)[-2:]

    async def _write_error(self, writer: ResponseWriter, content_type: str, error: APIError) -> None:
        body = orjson.dumps(error.body())
        if content_type.startswith("text/event-stream"):
            cut = b"" if self._tail in (b"", b"\n\n") else b"\n\n"
            await writer.write(cut + b"data: " + body + b"\n\ndata: [DONE]\n\n")  # as the server ends one
        else:
            cut = b"" if self._tail in (b"",) or self._tail.endswith(DELIM) else DELIM
            await writer.write(cut + body + DELIM)
