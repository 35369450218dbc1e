"""Prefill/decode disaggregation end to end, on real processes on loopback: a router, a prefill node and a decode
node (the demo model), the prompt's K/V moving between them over their gloo pair. Greedy outputs through the
router equal a standalone server's, on every route, streamed and not, for prompts shorter than a block, exactly
a block, and several blocks plus a partial one; no node keeps a block afterwards."""

from __future__ import annotations

import time

import httpx2
import openai
import orjson
import pytest

from ksana.router.process import RouterProcess
from tests.disagg import wait_for
from tests.server.conftest import ServerProcess

BLOCK = 16
PROMPT_LENGTHS = (5, BLOCK, 2 * BLOCK + 7)
MAX_TOKENS = 8


def _node(role: str, router_url: str, *extra: str) -> ServerProcess:
    return ServerProcess("--model", "demo", "--dtype", "float32", "--role", role, "--router", router_url,
                         "--heartbeat-interval-ms", "200", "--connector-waiting-sec", "5", *extra)


@pytest.fixture(scope="module")
def server():
    """A standalone server of the same model: the reference."""
    process = ServerProcess("--model", "demo", "--dtype", "float32")
    yield process.wait_ready()
    process.close()


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    """Router, prefill and decode node (prefix caching on at the decode node), with their pair connected."""
    router = RouterProcess("--db", str(tmp_path_factory.mktemp("router") / "router.db"),
                           "--heartbeat-timeout", "5").wait_ready()
    prefill = _node("prefill", router.url)
    decode = _node("decode", router.url, "--enable-prefix-caching")
    prefill.wait_ready()
    decode.wait_ready()
    try:
        for node in (prefill, decode):
            wait_for(lambda node=node: node.metrics().get("kv_transfer_pair_num") == 1, "the pair to connect")
        yield router, prefill, decode
    finally:
        for process in (decode, prefill, router):
            process.close()


def _prompt_ids(length: int) -> list[int]:
    return [100 + (7 * i) % 200 for i in range(length)]


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
def test_completions_through_the_router_equal_a_standalone_server(pd, server, length):
    router, prefill, decode = pd
    body = {"model": "demo", "prompt": _prompt_ids(length), "max_tokens": MAX_TOKENS, "temperature": 0.0}
    direct = server.client.post("/v1/completions", json=body).json()
    routed = httpx2.post(router.url + "/v1/completions", json=body, timeout=60).json()
    assert routed["choices"][0]["text"] == direct["choices"][0]["text"]
    assert routed["usage"]["prompt_tokens"] == length
    assert routed["usage"]["completion_tokens"] == MAX_TOKENS

    client = openai.OpenAI(base_url=router.url + "/v1", api_key="none")
    stream = client.completions.create(model="demo", prompt=_prompt_ids(length), max_tokens=MAX_TOKENS,
                                       temperature=0.0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == direct["choices"][0]["text"]


def test_chat_through_the_router_equals_a_standalone_server(pd, server):
    router, _, _ = pd
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    direct = openai.OpenAI(base_url=server.url + "/v1", api_key="none").chat.completions.create(
        model="demo", messages=messages, max_tokens=MAX_TOKENS, temperature=0.0)
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="none")
    routed = client.chat.completions.create(model="demo", messages=messages, max_tokens=MAX_TOKENS, temperature=0.0)
    assert routed.choices[0].message.content == direct.choices[0].message.content
    stream = client.chat.completions.create(model="demo", messages=messages, max_tokens=MAX_TOKENS, temperature=0.0,
                                            stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == direct.choices[0].message.content


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
def test_generate_through_the_router_equals_a_standalone_server(pd, server, length):
    router, _, _ = pd
    body = {"input_tokens": _prompt_ids(length), "sampling_config": {"max_new_tokens": MAX_TOKENS}}
    direct = server.client.post("/generate", json={**body, "stream": False}).json()
    routed = httpx2.post(router.url + "/generate", json={**body, "stream": False}, timeout=60).json()
    assert routed["output_token_ids"] == direct["output_token_ids"]
    with httpx2.stream("POST", router.url + "/generate", json=body, timeout=60) as response:
        raw = b"".join(response.iter_bytes())
    chunks = [orjson.loads(part) for part in raw.split(b"\0") if part and part != b"[DONE]"]
    assert chunks[-1]["output_token_ids"] == direct["output_token_ids"]
    counts = [len(chunk["output_token_ids"][0]) for chunk in chunks]
    assert counts == sorted(counts) and counts[0] >= 1


def test_the_kv_moves_once_a_request_and_no_node_keeps_blocks(pd):
    router, prefill, decode = pd
    before = prefill.metrics()["kv_transfer_sent_num"]
    body = {"model": "demo", "prompt": _prompt_ids(40), "max_tokens": 4, "temperature": 0.0}
    assert httpx2.post(router.url + "/v1/completions", json=body, timeout=60).status_code == 200
    sent = prefill.wait_metrics(lambda m: m["kv_transfer_sent_num"] == before + 1)
    assert sent["kv_transfer_sent_bytes"] > 0
    decode.wait_metrics(lambda m: m["kv_transfer_received_num"] >= before + 1)
    for node in (prefill, decode):
        node.wait_metrics(lambda m: m["block_manager_request_num"] == 0)


def test_the_decode_node_s_own_prefix_cache_serves_a_repeated_prompt(pd, server):
    """The second time, the decode node's prefix cache holds the prompt's full blocks: it writes only the rest of
    the received K/V and the answer is unchanged."""
    router, _, decode = pd
    body = {"model": "demo", "prompt": _prompt_ids(3 * BLOCK + 3), "max_tokens": MAX_TOKENS, "temperature": 0.0}
    direct = server.client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    hits = decode.metrics()["prefix_cache_hit_block_num"]
    for _ in range(2):
        assert httpx2.post(router.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"] \
            == direct
    assert decode.metrics()["prefix_cache_hit_block_num"] >= hits + 3


def test_a_decode_request_whose_kv_never_comes_ends_with_a_503_and_frees_nothing(pd):
    """Sent to the decode node alone (no prefill node computes it), it ends after ``--connector-waiting-sec``."""
    _, _, decode = pd
    headers = {"kv-comm-group-key": "127.0.0.1:1__127.0.0.1:2", "kv-comm-request-id": "12345"}
    body = {"model": "demo", "prompt": _prompt_ids(10), "max_tokens": 4, "temperature": 0.0}
    started = time.monotonic()
    response = decode.client.post("/v1/completions", json=body, headers=headers)
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "kv_transfer_failed"
    assert "within 5 s" in response.json()["error"]["message"]
    assert 5.0 <= time.monotonic() - started < 15.0
    decode.wait_metrics(lambda m: m["block_manager_request_num"] == 0)


def test_a_pair_serves_one_sequence_per_request(pd):
    router, _, _ = pd
    body = {"model": "demo", "prompt": "Hello", "max_tokens": 4, "n": 2}
    response = httpx2.post(router.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 400
    assert "one sequence per request" in response.json()["error"]["message"]
