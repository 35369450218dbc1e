"""Nodes that stop heartbeating, requests with no pair to go to, and a router restarted on its database."""

from __future__ import annotations

import time

import pytest

from tests.router.conftest import EchoUpstream, Router, wait_until


@pytest.fixture(scope="module")
def upstreams():
    processes = {name: EchoUpstream(name) for name in ("prefill", "decode")}
    try:
        yield {name: p.wait_ready() for name, p in processes.items()}
    finally:
        for p in processes.values():
            p.close()


def _online(router: Router, node_id: str) -> bool:
    return router.node(node_id)["is_online"]


def test_no_pair_is_503_at_once(tmp_path):
    router = Router("--db", str(tmp_path / "router.db")).wait_ready()
    try:
        router.register("127.0.0.1:1", "prefill")  # a prefill node alone makes no pair
        for path in ("/generate", "/v1/completions", "/v1/chat/completions", "/v2/anything"):
            started = time.monotonic()
            response = router.http.post(path, json={"prompt": "hi"})
            assert time.monotonic() - started < 2
            assert response.status_code == 503
            assert response.json() == {"error": {
                "message": "no prefill/decode pair is available: no active pair has both rank-0 nodes online "
                           "(see GET /nodes)", "type": "server_error", "param": None, "code": "no_available_pair"}}
        assert router.http.get("/health").json() == {"status": "healthy", "routable_pairs": 0}
    finally:
        router.close()


def test_a_silent_node_goes_offline_and_its_pairs_inactive(upstreams, tmp_path):
    router = Router("--db", str(tmp_path / "router.db"), "--heartbeat-timeout", "1").wait_ready()
    try:
        prefill, decode = router.pair(upstreams["prefill"].addr, upstreams["decode"].addr)
        key = f"{upstreams['prefill'].addr}__{upstreams['decode'].addr}"
        assert router.http.post("/generate", json={"stream": False}).json()["name"] == "decode"

        def keep_prefill_alive_and_read():
            router.heartbeat(prefill)
            return router.nodes()

        # /nodes reads a node's liveness at the call and its group's readiness as of the last heartbeat's refresh:
        # the prefill node's next heartbeat after the decode node's timeout makes the two agree
        def decode_group_down(n):
            node = next(x for x in n["nodes"] if x["node_id"] == decode)
            return not node["is_online"] and not node["group_ready"]

        nodes = wait_until(keep_prefill_alive_and_read, decode_group_down, what="decode node offline, group not ready")
        by_id = {node["node_id"]: node for node in nodes["nodes"]}
        assert by_id[decode]["group_ready"] is False and by_id[prefill]["is_online"] is True
        assert next(p for p in nodes["pairs"] if p["comm_key"] == key)["is_active"] is False
        started = time.monotonic()
        assert router.http.post("/generate", json={"stream": False}).status_code == 503
        assert time.monotonic() - started < 1

        router.heartbeat(decode)  # back: the next heartbeat pairs the groups again
        router.heartbeat(prefill)
        assert router.pair_row(key)["is_active"] is True
        assert router.http.post("/generate", json={"stream": False}).json()["name"] == "decode"
    finally:
        router.close()


def test_a_restarted_router_knows_its_nodes_and_routes_after_their_heartbeat(upstreams, tmp_path):
    db = tmp_path / "router.db"
    first = Router("--db", str(db), "--heartbeat-timeout", "1").wait_ready()
    try:
        prefill, decode = first.pair(upstreams["prefill"].addr, upstreams["decode"].addr)
        assert first.http.post("/generate", json={"stream": False}).status_code == 200
        before = {node["node_id"]: node for node in first.nodes()["nodes"]}
    finally:
        first.close()
    # The same SQLite file, named by URL this time: --db takes a path or a SQLAlchemy URL.
    second = Router("--db", f"sqlite:///{db}", "--heartbeat-timeout", "1").wait_ready()
    try:
        after = {node["node_id"]: node for node in second.nodes()["nodes"]}
        assert after.keys() == {prefill, decode}
        for node_id, node in after.items():
            for field in ("inference_addr", "group_role", "node_rank", "world_size", "devices", "coordinator_addr",
                          "created_at"):
                assert node[field] == before[node_id][field]
        wait_until(lambda: _online(second, prefill) or _online(second, decode), lambda online: not online,
                   what="nodes timed out")
        assert second.http.post("/generate", json={"stream": False}).status_code == 503
        second.heartbeat(prefill)
        second.heartbeat(decode)
        assert second.http.post("/generate", json={"stream": False}).json()["name"] == "decode"
    finally:
        second.close()
