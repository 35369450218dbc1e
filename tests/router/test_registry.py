"""RegisterNode, Heartbeat and RegisterCommId over real HTTP: bodies, answers, every refusal, groups and pairs.

One router serves the module; every test registers nodes at addresses of its own, and since the router pairs
every ready prefill group with every ready decode group, tests look at their own pairs only.
"""

from __future__ import annotations

import re
import uuid
from datetime import datetime

import pytest

from ksana.router import client
from tests.router.conftest import Router, call


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    process = Router("--db", str(tmp_path_factory.mktemp("registry") / "router.db"))
    yield process.wait_ready()
    process.close()


def _addr() -> str:
    """A node address no other test uses (nothing listens there: these tests never proxy)."""
    return f"10.0.0.1:{uuid.uuid4().int % 60000 + 1024}-{uuid.uuid4().hex[:6]}"


def _body(**overrides):
    body = {"inference_addr": _addr(), "cluster_name": "default_cluster", "group_role": "prefill", "node_rank": 0,
            "hostname": "host-a", "coordinator_addr": f"10.0.0.1:{uuid.uuid4().hex[:8]}", "world_size": 1,
            "devices": [{"device_id": 0, "device_type": "cpu", "device_ip": "10.0.0.1"}], "job_id": "job-7",
            "start_time": "2025-01-01T00:00:00"}
    return body | overrides


def test_register_node_answers_201_and_lists_the_node(router):
    body = _body(group_role="decode", world_size=2, devices=[{"device_id": 3}, {"device_id": 5}])
    response = router.http.post("/RegisterNode", json=body)
    assert response.status_code == 201
    answer = response.json()
    assert set(answer) == {"node_id", "is_online", "last_heartbeat"}
    assert re.fullmatch(r"[0-9a-f]{32}", answer["node_id"]) and answer["is_online"] is True
    assert datetime.fromisoformat(answer["last_heartbeat"]).tzinfo is not None
    node = router.node(answer["node_id"])
    for field in ("inference_addr", "cluster_name", "group_role", "node_rank", "hostname", "coordinator_addr",
                  "world_size", "job_id", "start_time"):
        assert node[field] == body[field], field
    assert node["device_num"] == 2 and [d["device_id"] for d in node["devices"]] == [3, 5]
    assert node["is_online"] is True and node["last_heartbeat"] == answer["last_heartbeat"]
    assert node["group_ready"] is True and node["pairs"] == []  # both devices of world_size 2 are this node's


def test_registering_again_updates_the_same_row(router):
    body = _body()
    first = router.http.post("/RegisterNode", json=body).json()["node_id"]
    again = router.http.post("/RegisterNode", json=body | {"hostname": "host-b"}).json()["node_id"]
    assert again == first
    mine = [n for n in router.nodes()["nodes"] if n["inference_addr"] == body["inference_addr"]]
    assert len(mine) == 1 and mine[0]["hostname"] == "host-b"
    chosen = router.http.post("/RegisterNode", json=_body(node_id="my-own-id")).json()["node_id"]
    assert chosen == "my-own-id"


@pytest.mark.parametrize(("change", "message", "code"), [
    ({"cluster_name": "other"}, "cluster_name 'other' is not this router's cluster 'default_cluster'",
     "wrong_cluster"),
    ({"devices": []}, "devices: at least one device is required", "missing_devices"),
    ({"devices": None}, "devices: Field required", "invalid_type"),
    ({"world_size": None}, "world_size: Field required", "invalid_type"),
    ({"world_size": 1, "devices": [{"device_id": 0}, {"device_id": 1}]},
     "world_size 1 is below the node's 2 devices", "invalid_world_size"),
    ({"group_role": "mixed"}, "group_role: Input should be 'prefill' or 'decode'", "invalid_type"),
    ({"node_rank": "0"}, "node_rank: Input should be a valid integer", "invalid_type"),
])
def test_register_node_refusals(router, change, message, code):
    body = {k: v for k, v in (_body() | change).items() if v is not None}
    response = router.http.post("/RegisterNode", json=body)
    assert response.status_code == 400
    assert response.json() == {"error": {"message": message, "type": "invalid_request_error",
                                         "param": response.json()["error"]["param"], "code": code}}
    assert all(n["inference_addr"] != body["inference_addr"] for n in router.nodes()["nodes"])


def test_malformed_bodies_are_400(router):
    for path in ("/RegisterNode", "/Heartbeat", "/RegisterCommId"):
        response = router.http.post(path, content=b"{not json")
        assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json", path
    response = router.http.post("/Heartbeat", json={})
    assert response.status_code == 400 and response.json()["error"]["message"] == "node_id: Field required"


def test_unknown_node_is_404(router):
    response = router.http.post("/Heartbeat", json={"node_id": "nobody"})
    assert response.status_code == 404
    assert response.json()["error"] == {"message": "node 'nobody' is not registered (register it with "
                                                   "/RegisterNode)", "type": "invalid_request_error",
                                        "param": "node_id", "code": "unknown_node"}
    response = router.http.post("/RegisterCommId", json={"node_id": "nobody", "comm_key": "a__b", "comm_id": "x"})
    assert response.status_code == 404 and response.json()["error"]["code"] == "unknown_node"


def test_heartbeat_pairs_ready_groups_and_names_their_devices(router):
    prefill_addr, decode_addr = _addr(), _addr()
    prefill = router.register(prefill_addr, "prefill", coordinator="10.0.0.2:7000")
    decode = router.register(decode_addr, "decode", num_devices=2, world_size=2, coordinator="10.0.0.3:7000")
    key = f"{prefill_addr}__{decode_addr}"
    assert router.pair_row(key) is None  # pairs come from heartbeats
    answer = router.heartbeat(decode)
    assert set(answer) == {"node_id", "is_online", "group_ready", "coordinator_addr", "node_role", "timestamp",
                           "comm_group_to_address", "comm_group_to_id"}
    assert answer["node_id"] == decode and answer["is_online"] is True and answer["group_ready"] is True
    assert answer["node_role"] == "decode" and answer["coordinator_addr"] == "10.0.0.3:7000"
    assert answer["comm_group_to_address"][key] == [[0, 0, "10.0.0.2:7000"], [0, 0, "10.0.0.3:7000"],
                                                    [0, 1, "10.0.0.3:7000"]]
    assert answer["comm_group_to_id"][key] == ""
    assert all(k.endswith(f"__{decode_addr}") for k in answer["comm_group_to_address"])  # only its own pairs
    row = router.pair_row(key)
    assert row["is_active"] is True and row["prefill_addr"] == prefill_addr and row["decode_addr"] == decode_addr
    assert {"comm_key": key, "is_active": True} in router.node(prefill)["pairs"]


def test_register_comm_id_reaches_the_decode_node(router):
    prefill_addr, decode_addr = _addr(), _addr()
    prefill, decode = router.pair(prefill_addr, decode_addr)
    key = client.comm_key(prefill_addr, decode_addr)
    answer = call(client.register_comm_id, router.url, prefill, key, "bmNjbC1pZA==")
    assert answer == {"status": "OK", "comm_id": "bmNjbC1pZA=="}
    assert router.heartbeat(decode)["comm_group_to_id"][key] == "bmNjbC1pZA=="
    row = router.pair_row(key)
    assert row["comm_id"] == "bmNjbC1pZA=="
    assert row["control_channel_meta"] == [[0, 0, f"prefill-{prefill_addr}-0"], [0, 0, f"decode-{decode_addr}-0"]]


def test_register_comm_id_refusals(router):
    prefill_addr, decode_addr, other_addr = _addr(), _addr(), _addr()
    prefill, decode = router.pair(prefill_addr, decode_addr)
    key = client.comm_key(prefill_addr, decode_addr)
    with pytest.raises(client.RouterError) as refused:
        call(client.register_comm_id, router.url, decode, key, "id")
    assert refused.value.status == 403 and refused.value.code == "not_prefill_rank_0"
    assert refused.value.message == f"only a prefill node of rank 0 registers comm ids; node {decode} is decode rank 0"
    rank1 = router.register(prefill_addr, "prefill", rank=1)
    with pytest.raises(client.RouterError) as refused:
        call(client.register_comm_id, router.url, rank1, key, "id")
    assert refused.value.status == 403 and "is prefill rank 1" in refused.value.message
    cases = {
        "no-separator": "comm_key 'no-separator' is not '<prefill_addr>__<decode_addr>'",
        f"{other_addr}__{decode_addr}": f"names prefill '{other_addr}', not this node's '{prefill_addr}'",
        f"{prefill_addr}__{other_addr}": "is no pair of this cluster",
    }
    for bad_key, message in cases.items():
        with pytest.raises(client.RouterError) as refused:
            call(client.register_comm_id, router.url, prefill, bad_key, "id")
        assert refused.value.status == 400 and refused.value.code == "invalid_comm_key"
        assert message in refused.value.message
    assert router.pair_row(key)["comm_id"] is None


def test_a_two_rank_group_is_ready_once_both_ranks_are_online(router):
    prefill_addr, decode_addr = _addr(), _addr()
    router.register(decode_addr, "decode")
    rank0 = router.register(prefill_addr, "prefill", world_size=2, coordinator="10.0.1.1:1")
    answer = router.heartbeat(rank0)
    key = client.comm_key(prefill_addr, decode_addr)
    assert answer["group_ready"] is False and key not in answer["comm_group_to_address"]
    assert router.node(rank0)["group_ready"] is False and router.pair_row(key) is None
    rank1 = router.register(prefill_addr, "prefill", rank=1, world_size=2, coordinator="10.0.1.2:1")
    answer = router.heartbeat(rank1)
    assert answer["group_ready"] is True
    assert answer["comm_group_to_address"][key] == [[0, 0, "10.0.1.1:1"], [1, 0, "10.0.1.2:1"],
                                                    [0, 0, f"decode-{decode_addr}-0"]]
    assert router.node(rank0)["group_ready"] is True and router.pair_row(key)["is_active"] is True


def test_prefill_rank0_registering_again_voids_its_comm_ids(router):
    prefill_addr, decode_addr = _addr(), _addr()
    prefill, decode = router.pair(prefill_addr, decode_addr)
    key = client.comm_key(prefill_addr, decode_addr)
    call(client.register_comm_id, router.url, prefill, key, "old-id")
    again = router.register(prefill_addr, "prefill")  # a restarted process at the same rank and coordinator
    assert again == prefill
    row = router.pair_row(key)
    assert row["is_active"] is False and row["comm_id"] is None and row["control_channel_meta"] is None
    answer = router.heartbeat(prefill)
    assert answer["comm_group_to_id"][key] == "" and router.pair_row(key)["is_active"] is True


def test_client_reports_an_unreachable_router():
    with pytest.raises(client.RouterError) as failed:
        call(client.heartbeat, "http://127.0.0.1:9", "n")
    assert failed.value.status is None and "did not answer /Heartbeat" in failed.value.message


def test_unknown_path_is_404_in_openai_form(router):
    response = router.http.get("/v0/models")
    assert response.status_code == 404
    assert response.json() == {"error": {"message": "GET /v0/models: Not Found", "type": "invalid_request_error",
                                         "param": None, "code": "not_found"}}
    response = router.http.get("/generate")
    assert response.status_code == 405 and response.json()["error"]["code"] == "method_not_allowed"
