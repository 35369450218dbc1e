"""The router in front of two real ``ksana serve`` processes registered as a prefill and a decode node.

Standalone servers ignore the coordination headers and both generate the whole answer, which is what the proxy's
mechanics need: greedy answers through the router must equal the decode server's own, through the ``openai``
client too.
"""

from __future__ import annotations

import openai
import orjson
import pytest

from tests.router.conftest import Router
from tests.server.conftest import ServerProcess

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def nodes():
    processes = {role: ServerProcess("--model", "demo", "--dtype", "float32") for role in ("prefill", "decode")}
    try:
        yield {role: p.wait_ready() for role, p in processes.items()}
    finally:
        for p in processes.values():
            p.close()


@pytest.fixture(scope="module")
def router(nodes, tmp_path_factory):
    process = Router("--db", str(tmp_path_factory.mktemp("serve") / "router.db"))
    try:
        process.wait_ready()
        process.pair(*(nodes[role].url.removeprefix("http://") for role in ("prefill", "decode")))
        yield process
    finally:
        process.close()


def _openai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def _nul_chunks(raw: bytes) -> list[dict]:
    parts = raw.split(b"\0")
    assert parts[-1] == b"", "every chunk ends with a NUL byte"
    return [orjson.loads(part) for part in parts[:-1]]


def test_answers_that_are_not_streamed_equal_the_decode_servers(router, nodes):
    via, direct = _openai(router.url), _openai(nodes["decode"].url)
    kwargs = {"model": "demo", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    routed, own = via.completions.create(**kwargs), direct.completions.create(**kwargs)
    assert routed.choices[0].text == own.choices[0].text and routed.usage == own.usage
    body = {"prompt": PROMPT, "stream": False, "sampling_config": {"max_new_tokens": 12}}
    assert router.http.post("/generate", json=body).json() == nodes["decode"].client.post("/generate", json=body).json()
    assert [m.id for m in via.models.list()] == [m.id for m in direct.models.list()]


def test_streamed_completions_through_the_openai_client(router, nodes):
    kwargs = {"model": "demo", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stream": True,
              "stream_options": {"include_usage": True}}
    routed = list(_openai(router.url).completions.create(**kwargs))
    own = list(_openai(nodes["decode"].url).completions.create(**kwargs))
    assert len(routed) > 2  # streamed as the tokens come (a busy server may put several tokens in one event)
    assert "".join(c.choices[0].text for c in routed[:-1]) == "".join(c.choices[0].text for c in own[:-1])
    assert routed[-2].choices[0].finish_reason == own[-2].choices[0].finish_reason == "length"
    assert routed[-1].usage == own[-1].usage


def test_streamed_chat_through_the_openai_client(router, nodes):
    kwargs = {"model": "demo", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 16,
              "temperature": 0, "stream": True}
    routed = list(_openai(router.url).chat.completions.create(**kwargs))
    own = list(_openai(nodes["decode"].url).chat.completions.create(**kwargs))
    assert routed[0].choices[0].delta.role == "assistant"
    assert len(routed) > 2
    assert "".join(c.choices[0].delta.content or "" for c in routed) == \
        "".join(c.choices[0].delta.content or "" for c in own)
    assert routed[-1].choices[0].finish_reason == own[-1].choices[0].finish_reason


def test_generate_stream_is_the_prefill_chunk_then_the_decode_stream(router, nodes):
    body = {"prompt": PROMPT, "sampling_config": {"max_new_tokens": 10}}
    with router.http.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200 and response.headers["content-type"] == "application/octet-stream"
        routed = _nul_chunks(response.read())
    with nodes["decode"].client.stream("POST", "/generate", json=body) as response:
        own = _nul_chunks(response.read())
    # The prefill node's first chunk (its first token), unless the decode node's came first, then the decode
    # node's cumulative chunks. How many tokens each carries depends on the servers' pace, not on the router (on a
    # busy machine the decode node's first chunk may already hold several), so what is checked is that the counts
    # never shrink and that every chunk is a prefix of the final output.
    assert routed[-1] == own[-1]
    final = own[-1]["output_token_ids"][0]
    counts = [len(chunk["output_token_ids"][0]) for chunk in routed]
    assert counts == sorted(counts) and counts[-1] == 10
    for chunk in routed:
        assert chunk["output_token_ids"][0] == final[:len(chunk["output_token_ids"][0])]
        assert own[-1]["texts"][0].startswith(chunk["texts"][0])


def test_a_bad_body_is_the_nodes_400(router, nodes):
    with pytest.raises(openai.BadRequestError) as refused:
        _openai(router.url).completions.create(model="demo", prompt=PROMPT, max_tokens=4, temperature=-1)
    direct = nodes["decode"].client.post("/v1/completions", json={"model": "demo", "prompt": PROMPT,
                                                                  "max_tokens": 4, "temperature": -1})
    assert refused.value.status_code == 400 and refused.value.body == direct.json()["error"]
