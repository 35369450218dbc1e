"""A scripted upstream for the router's proxy tests: it records what reaches it and answers as the body says.

Run as ``python -P echo_upstream.py NAME``; prints ``Echo upstream NAME at http://HOST:PORT`` once listening.
The router sends one body to both nodes, so a body's ``"echo"`` maps each upstream's NAME to its script:
- ``{"status": 400, "json": {...}}``: a whole JSON answer (the default answers 200 with its name and path);
- ``{"stream": [step, ...], "content_type": "..."}``: a chunked answer, one step at a time:
  ``{"send": "text"}``, ``{"wait": "event"}`` (until ``POST /release {"event"}``), ``{"fail": true}`` (cut the
  connection mid-stream), ``{"hold": true}`` (stay open until the client leaves).
``GET /requests`` lists every request seen: path, method, headers, body and its state (``open``, ``done``,
``disconnected``).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

NAME = sys.argv[1]
records: list[dict] = []
events: defaultdict[str, trio.Event] = defaultdict(trio.Event)


async def _read_body(receive) -> bytes:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


async def _json(send, obj, status: int = 200) -> None:
    body = json.dumps(obj).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def app(scope, receive, send) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    body = await _read_body(receive)
    if scope["path"] == "/requests":
        await _json(send, records)
        return
    if scope["path"] == "/release":
        events[json.loads(body)["event"]].set()
        await _json(send, {"released": True})
        return
    record = {"path": scope["path"], "method": scope["method"], "body": body.decode(), "state": "open",
              "headers": {k.decode(): v.decode() for k, v in scope["headers"]}}
    records.append(record)
    script = (json.loads(body).get("echo") or {}).get(NAME, {}) if body else {}
    if "stream" not in script:
        await _json(send, script.get("json", {"name": NAME, "path": scope["path"]}), script.get("status", 200))
        record["state"] = "done"
        return
    async with trio.open_nursery() as nursery:
        async def watch_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            if record["state"] == "open":
                record["state"] = "disconnected"
                nursery.cancel_scope.cancel()

        nursery.start_soon(watch_disconnect)
        content_type = script.get("content_type", "application/octet-stream").encode()
        await send({"type": "http.response.start", "status": script.get("status", 200),
                    "headers": [(b"content-type", content_type)]})
        for step in script["stream"]:
            if "send" in step:
                await send({"type": "http.response.body", "body": step["send"].encode(), "more_body": True})
            elif "wait" in step:
                await events[step["wait"]].wait()
            elif "hold" in step:
                await trio.sleep_forever()
            elif "fail" in step:
                record["state"] = "failed"
                raise RuntimeError("scripted failure: the connection is cut mid-stream")
        record["state"] = "done"
        await send({"type": "http.response.body", "body": b""})
        nursery.cancel_scope.cancel()


async def main() -> None:
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(serve, app, config)
        print(f"Echo upstream {NAME} at {binds[0]}", flush=True)


if __name__ == "__main__":
    trio.run(main)
