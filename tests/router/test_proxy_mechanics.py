"""The proxy against scripted upstreams: headers, which answer wins, the /generate merge, streams that fail or are
left, and the pair policies.

``echo_upstream.py`` answers what each request's body scripts for it by name, records what reached it, and holds
a stream at a named event until the test releases it, so every ordering below is forced, not timed.
"""

from __future__ import annotations

import socket
import time
import uuid

import orjson
import pytest

from tests.router.conftest import EchoUpstream, Router, wait_until


@pytest.fixture(scope="module")
def upstreams():
    processes = {name: EchoUpstream(name) for name in ("prefill", "decode", "decode2")}
    try:
        yield {name: p.wait_ready() for name, p in processes.items()}
    finally:
        for p in processes.values():
            p.close()


@pytest.fixture(scope="module")
def routers(upstreams, tmp_path_factory):
    """``one``: one pair (prefill, decode); ``random`` and ``least``: two pairs sharing the prefill node."""
    folder = tmp_path_factory.mktemp("routers")
    processes = {"one": Router("--db", str(folder / "one.db")),
                 "random": Router("--db", str(folder / "random.db")),
                 "least": Router("--db", str(folder / "least.db"), "--policy", "least_in_flight")}
    try:
        for name, router in processes.items():
            router.wait_ready()
            router.pair(upstreams["prefill"].addr, upstreams["decode"].addr)
            if name != "one":
                decode2 = router.register(upstreams["decode2"].addr, "decode")
                router.heartbeat(decode2)
                assert len(router.nodes()["pairs"]) == 2
        yield processes
    finally:
        for p in processes.values():
            p.close()


@pytest.fixture(scope="module")
def router(routers):
    return routers["one"]


def _tag() -> str:
    return uuid.uuid4().hex


def _events(data: bytes, sep: bytes = b"\0") -> list[bytes]:
    return [event for event in data.split(sep) if event]


def test_both_nodes_get_the_body_the_headers_and_one_request_id(router, upstreams):
    tags, ids = [_tag(), _tag()], []
    for tag in tags:
        body = orjson.dumps({"prompt": "hi", "tag": tag})
        response = router.http.post("/v1/completions?mode=x", content=body, headers={
            "content-type": "application/json", "authorization": "Bearer k", "x-trace": tag,
            "kv-comm-request-id": "999"})  # a client's own value is replaced
        assert response.status_code == 200
        seen = {name: upstreams[name].tagged(tag) for name in ("prefill", "decode")}
        for name, record in seen.items():
            assert record["path"] == "/v1/completions" and record["method"] == "POST", name
            assert record["body"] == body.decode(), name
            headers = record["headers"]
            assert headers["kv-comm-group-key"] == f"{upstreams['prefill'].addr}__{upstreams['decode'].addr}"
            assert headers["x-trace"] == tag and headers["authorization"] == "Bearer k"
            assert headers["content-type"] == "application/json" and headers["x-remote-ip"] == "127.0.0.1"
            assert headers["host"] == upstreams[name].addr
        request_id = seen["prefill"]["headers"]["kv-comm-request-id"]
        assert seen["decode"]["headers"]["kv-comm-request-id"] == request_id
        assert 0 < int(request_id) < 2**31 and request_id != "999"
        ids.append(request_id)
    assert ids[0] != ids[1]


def test_an_answer_that_is_not_streamed_is_the_decode_nodes(router):
    response = router.http.post("/generate", json={"stream": False, "echo": {
        "prefill": {"json": {"from": "prefill"}}, "decode": {"status": 422, "json": {"from": "decode"}}}})
    assert response.status_code == 422 and response.json() == {"from": "decode"}
    assert response.headers["content-type"] == "application/json"
    response = router.http.get("/v1/models")
    assert response.status_code == 200 and response.json() == {"name": "decode", "path": "/v1/models"}


def test_an_error_from_the_prefill_node_is_the_answer(router):
    error = {"error": {"message": "bad body", "type": "invalid_request_error", "param": None, "code": None}}
    for decode_script in ({"json": {"from": "decode"}}, {"stream": [{"send": "D1\0"}]}):
        response = router.http.post("/generate", json={"echo": {"prefill": {"status": 400, "json": error},
                                                                "decode": decode_script}})
        assert response.status_code == 400 and response.json() == error


def test_generate_streams_the_prefill_chunk_then_the_decode_stream(router, upstreams):
    go = _tag()
    script = {"prefill": {"stream": [{"send": '{"n":1}\0'}, {"send": '{"n":"prefill-late"}\0'}]},
              "decode": {"stream": [{"wait": go}, {"send": '{"n":1}\0{"n'}, {"send": '":2}\0'}, {"send": '{"n":3}\0'}]}}
    with router.http.stream("POST", "/generate", json={"echo": script}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"] == "application/octet-stream"
        chunks = response.iter_raw()
        first = next(chunks)  # the decode node sends nothing before the release: this is the prefill node's
        assert first == b'{"n":1}\0'
        upstreams["decode"].release(go)
        rest = b"".join(chunks)
    assert _events(first + rest) == [b'{"n":1}', b'{"n":1}', b'{"n":2}', b'{"n":3}']


def test_generate_skips_the_prefill_chunk_once_the_decode_node_spoke(router, upstreams):
    prefill_go, decode_go, tag = _tag(), _tag(), _tag()
    script = {"prefill": {"stream": [{"wait": prefill_go}, {"send": '{"n":"prefill"}\0'}]},
              "decode": {"stream": [{"send": '{"n":1}\0'}, {"wait": decode_go}, {"send": '{"n":2}\0'}]}}
    with router.http.stream("POST", "/generate", json={"echo": script, "tag": tag}) as response:
        chunks = response.iter_raw()
        assert next(chunks) == b'{"n":1}\0'
        upstreams["prefill"].release(prefill_go)
        wait_until(lambda: upstreams["prefill"].tagged(tag)["state"], lambda s: s == "done", what="prefill sent")
        upstreams["decode"].release(decode_go)
        rest = b"".join(chunks)
    assert rest == b'{"n":2}\0'


def test_openai_streams_are_the_decode_nodes_sse(router):
    sse = 'data: {"choices":[{"text":"a"}]}\n\n'
    script = {"prefill": {"stream": [{"send": 'data: {"prefill":1}\n\n'}], "content_type": "text/event-stream"},
              "decode": {"stream": [{"send": sse}, {"send": "data: [DONE]\n\n"}],
                         "content_type": "text/event-stream; charset=utf-8"}}
    with router.http.stream("POST", "/v1/completions", json={"echo": script}) as response:
        assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
        assert response.read() == (sse + "data: [DONE]\n\n").encode()


@pytest.mark.parametrize(("path", "content_type"), [("/generate", "application/octet-stream"),
                                                    ("/v1/chat/completions", "text/event-stream")])
def test_a_decode_node_failing_mid_stream_ends_the_stream_with_an_error(router, path, content_type):
    sse = content_type == "text/event-stream"
    first = 'data: {"n":1}\n\n' if sse else '{"n":1}\0'
    script = {"prefill": {"stream": [], "content_type": content_type},
              "decode": {"stream": [{"send": first}, {"send": "cut-"}, {"fail": True}], "content_type": content_type}}
    started = time.monotonic()
    with router.http.stream("POST", path, json={"echo": script}) as response:
        data = response.read()
    assert time.monotonic() - started < 10
    events = _events(data, b"\n\n" if sse else b"\0")
    assert events[:2] == [first.encode().rstrip(b"\n\0"), b"cut-"]  # the cut event is closed off
    assert events[3:] == ([b"data: [DONE]"] if sse else [])
    error = orjson.loads(events[2].removeprefix(b"data: "))["error"]
    assert error["code"] == "upstream_failed" and "failed mid-stream" in error["message"]


def test_a_client_that_leaves_closes_both_upstream_requests(router, upstreams):
    tag = _tag()
    script = {"prefill": {"stream": [{"send": "P\0"}, {"hold": True}]},
              "decode": {"stream": [{"send": "D\0"}, {"hold": True}]}}
    with router.http.stream("POST", "/generate", json={"echo": script, "tag": tag}) as response:
        next(response.iter_raw())
    for name in ("prefill", "decode"):
        wait_until(lambda n=name: upstreams[n].tagged(tag)["state"], lambda s: s == "disconnected",
                   what=f"{name} request closed")


def test_the_prefill_answer_is_read_to_its_end_not_cut(router, upstreams):
    go, tag = _tag(), _tag()
    script = {"prefill": {"stream": [{"send": "P\0"}, {"wait": go}, {"send": "P2\0"}]},
              "decode": {"stream": [{"send": "D\0"}]}}
    response = router.http.post("/generate", json={"echo": script, "tag": tag})
    assert response.status_code == 200 and _events(response.content)[-1] == b"D"
    assert upstreams["prefill"].tagged(tag)["state"] == "open"  # the client is done; the prefill node is not
    upstreams["prefill"].release(go)
    wait_until(lambda: upstreams["prefill"].tagged(tag)["state"], lambda s: s == "done", what="prefill drained")


def test_an_unreachable_node_is_502(upstreams, tmp_path):
    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens there
        sock.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{sock.getsockname()[1]}"
    router = Router("--db", str(tmp_path / "r.db")).wait_ready()
    try:
        router.pair(upstreams["prefill"].addr, closed)
        response = router.http.post("/generate", json={})
        assert response.status_code == 502
        error = response.json()["error"]
        assert error["code"] == "upstream_unreachable"
        assert error["message"].startswith(f"the decode node {closed} did not answer: ConnectError")
    finally:
        router.close()


def test_least_in_flight_avoids_the_busy_pair(routers, upstreams):
    router = routers["least"]
    go, tag = _tag(), _tag()
    hold = {"stream": [{"send": "D\0"}, {"wait": go}]}
    with router.http.stream("POST", "/generate", json={"echo": {"decode": hold, "decode2": hold}, "tag": tag}) as busy:
        chunks = busy.iter_raw()  # held: a dropped iterator would close the response
        assert next(chunks) == b"D\0"
        busy_name = "decode" if upstreams["decode"].tagged(tag) else "decode2"
        other = {"decode": "decode2", "decode2": "decode"}[busy_name]
        for _ in range(6):
            assert router.http.post("/generate", json={"stream": False}).json()["name"] == other
        upstreams[busy_name].release(go)
        assert b"".join(chunks) == b""


def test_random_uses_every_pair(routers):
    names = {routers["random"].http.post("/generate", json={"stream": False}).json()["name"] for _ in range(40)}
    assert names == {"decode", "decode2"}  # each of 40 picks misses one of two pairs with odds 2**-39
