"""A prefill and a decode node with two tensor-parallel ranks each: every rank sends its own KV heads to the
matching rank of its peer, and greedy outputs through the router equal a standalone server's."""

from __future__ import annotations

import httpx2
import pytest

from ksana.router.process import RouterProcess
from tests.disagg import wait_for
from tests.disagg.test_pd_serving import MAX_TOKENS, PROMPT_LENGTHS, _node, _prompt_ids
from tests.server.conftest import ServerProcess


@pytest.fixture(scope="module")
def tp_pair(tmp_path_factory):
    router = RouterProcess("--db", str(tmp_path_factory.mktemp("router") / "router.db")).wait_ready()
    nodes = [_node(role, router.url, "--tensor-para-size", "2") for role in ("prefill", "decode")]
    standalone = ServerProcess("--model", "demo", "--dtype", "float32")
    try:
        for process in (*nodes, standalone):
            process.wait_ready()
        for node in nodes:
            wait_for(lambda node=node: node.metrics().get("kv_transfer_pair_num") == 1, "the pair to connect")
        yield router, nodes, standalone
    finally:
        for process in (*nodes, standalone, router):
            process.close()


def test_a_tensor_parallel_pair_serves_what_a_standalone_server_does(tp_pair):
    router, (prefill, decode), standalone = tp_pair
    for length in PROMPT_LENGTHS:
        body = {"model": "demo", "prompt": _prompt_ids(length), "max_tokens": MAX_TOKENS, "temperature": 0.0}
        direct = standalone.client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        routed = httpx2.post(router.url + "/v1/completions", json=body, timeout=60).json()
        assert routed["choices"][0]["text"] == direct
    prefill.wait_metrics(lambda m: m["kv_transfer_sent_num"] == len(PROMPT_LENGTHS))
    for node in (prefill, decode):
        node.wait_metrics(lambda m: m["block_manager_request_num"] == 0)
