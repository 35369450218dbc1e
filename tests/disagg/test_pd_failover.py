"""A decode node killed (SIGKILL) while streams run through it, with two prefill and two decode nodes: its
streams end with an error event at once, the other streams finish, requests succeed on the remaining pairs once
the router's heartbeat timeout has passed, and no surviving node keeps a block."""

from __future__ import annotations

import threading
import time

import httpx2
import orjson
import pytest

from ksana.router.process import RouterProcess
from tests.disagg import wait_for
from tests.disagg.test_pd_serving import _node, _prompt_ids

HEARTBEAT_TIMEOUT_S = 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    router = RouterProcess("--db", str(tmp_path_factory.mktemp("router") / "router.db"), "--heartbeat-timeout",
                           str(HEARTBEAT_TIMEOUT_S), "--policy", "least_in_flight").wait_ready()
    prefills = [_node("prefill", router.url) for _ in range(2)]
    decodes = [_node("decode", router.url) for _ in range(2)]
    nodes = prefills + decodes
    try:
        for node in nodes:
            node.wait_ready()
        for node in nodes:
            wait_for(lambda node=node: node.metrics().get("kv_transfer_pair_num") == 2, "every pair to connect")
        yield router, prefills, decodes
    finally:
        for process in [*nodes, router]:
            process.close()


def _stream(url: str, outcome: dict) -> None:
    """One long streamed completion; records its events and how it ended."""
    body = {"model": "demo", "prompt": _prompt_ids(20), "max_tokens": 1500, "temperature": 0.0, "stream": True,
            "ignore_eos": True}
    events = []
    try:
        with httpx2.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
            outcome["status"] = response.status_code
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    outcome["started"] = True
    finally:
        outcome["events"] = events
        outcome["ended_at"] = time.monotonic()


def test_a_killed_decode_node_s_streams_end_with_an_error_and_the_rest_go_on(cluster):
    router, prefills, decodes = cluster
    outcomes = [{} for _ in range(4)]  # least in-flight: one stream on each of the four pairs
    threads = [threading.Thread(target=_stream, args=(router.url, outcome)) for outcome in outcomes]
    for started, thread in enumerate(threads, start=1):
        thread.start()
        wait_for(lambda started=started: decodes[0].metrics()["kv_transfer_received_num"]
                  + decodes[1].metrics()["kv_transfer_received_num"] >= started, "the stream's first token")
    wait_for(lambda: all(o.get("started") for o in outcomes), "every stream to start")
    victim, survivor = decodes
    victim.proc.kill()
    killed_at = time.monotonic()
    for thread in threads:
        thread.join(120)
        assert not thread.is_alive(), "a stream hangs"

    failed = [o for o in outcomes if any('"error"' in e for e in o["events"])]
    finished = [o for o in outcomes if o["events"] and o["events"][-1] == "[DONE]" and o not in failed]
    assert len(failed) == 2 and len(finished) == 2
    for outcome in failed:
        assert outcome["ended_at"] - killed_at < 10
        assert outcome["events"][-1] == "[DONE]"
        error = next(orjson.loads(e) for e in outcome["events"] if '"error"' in e)
        assert "decode node" in error["error"]["message"]

    # Once the killed node's heartbeat times out, its pairs are inactive and every request finds a live pair.
    wait_for(lambda: all(not p["is_active"] for p in httpx2.get(router.url + "/nodes").json()["pairs"]
                          if p["decode_addr"] == victim.url.removeprefix("http://")), "the dead pairs to go",
              timeout_s=HEARTBEAT_TIMEOUT_S + 10)
    body = {"model": "demo", "prompt": _prompt_ids(20), "max_tokens": 4, "temperature": 0.0}
    for _ in range(6):
        assert httpx2.post(router.url + "/v1/completions", json=body, timeout=60).status_code == 200
    for node in (*prefills, survivor):
        node.wait_metrics(lambda m: m["block_manager_request_num"] == 0)
