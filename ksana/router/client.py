"""What a prefill or decode node calls on the router: register, heartbeat, and (prefill rank 0) register comm ids.

Async functions on ``httpx2`` (they run under trio or asyncio). Each returns the router's JSON answer as a dict
and raises ``RouterError`` on a non-2xx status or when the router cannot be reached, so a node's heartbeat loop
catches one exception type. Pass ``client`` to reuse one connection pool across calls (a heartbeat loop should).

Answers (KsanaLLM's):
- ``register_node`` (201): ``{"node_id", "is_online", "last_heartbeat"}`` (ISO 8601, UTC);
- ``heartbeat``: ``{"node_id", "is_online", "group_ready", "coordinator_addr", "node_role", "timestamp",
  "comm_group_to_address": {comm_key: [[node_rank, device_id, coordinator_addr], ...]},
  "comm_group_to_id": {comm_key: comm_id or ""}}`` for the active pairs of the node's group; the address list
  holds the prefill group's devices by rank, then the decode group's;
- ``register_comm_id``: ``{"status": "OK", "comm_id"}``.

Errors (``RouterError.status``): 400 (wrong cluster, no devices, ``world_size`` below the node's devices, a bad
body or comm key), 403 (a comm id from a node that is not prefill rank 0), 404 (unknown ``node_id``: register
again), ``None`` (the router did not answer).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import httpx2

from ksana.router.protocol import KV_COMM_GROUP_KEY, KV_COMM_REQUEST_ID, comm_key, split_comm_key

__all__ = ["KV_COMM_GROUP_KEY", "KV_COMM_REQUEST_ID", "Device", "NodeRegistration", "RouterError", "comm_key",
           "heartbeat", "register_comm_id", "register_node", "split_comm_key"]

DEFAULT_TIMEOUT_S = 10.0


class RouterError(Exception):
    """The router refused a call (``status`` and its message) or could not be reached (``status`` None)."""

    def __init__(self, status: int | None, message: str, code: str | None = None) -> None:
        super().__init__(f"router answered {status}: {message}" if status is not None else message)
        self.status = status
        self.message = message
        self.code = code


@attrs.frozen
class Device:
    device_id: int
    device_type: str = "cpu"  # "cpu", "cuda", "npu"
    device_ip: str = ""


@attrs.frozen
class NodeRegistration:
    """The ``/RegisterNode`` body. A group is the nodes of one role sharing ``inference_addr``; it is ready when
    the devices of its online nodes add up to ``world_size``."""

    inference_addr: str  # "host:port" where the group's rank 0 serves HTTP
    group_role: str  # "prefill" or "decode"
    world_size: int  # devices in the whole group
    devices: tuple[Device, ...]  # this node's devices
    cluster_name: str = "default_cluster"
    node_rank: int = 0
    hostname: str = ""
    coordinator_addr: str = ""  # bare "IP:port" of this node's control channel
    job_id: str | None = None
    start_time: str | None = None
    comm_id: str | None = None
    node_id: str | None = None  # set when registering again, to keep the id the router gave

    def to_body(self) -> dict[str, Any]:
        return attrs.asdict(self, value_serializer=lambda _inst, _field, value: (
            list(value) if isinstance(value, tuple) else value))


async def register_node(router_url: str, body: NodeRegistration | Mapping[str, Any], *,
                        client: httpx2.AsyncClient | None = None,
                        timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """``POST /RegisterNode``; the answer's ``node_id`` names the node in every later call."""
    payload = body.to_body() if isinstance(body, NodeRegistration) else dict(body)
    return await _post(router_url, "/RegisterNode", payload, client, timeout_s)


async def heartbeat(router_url: str, node_id: str, *, client: httpx2.AsyncClient | None = None,
                    timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """``POST /Heartbeat``: keeps the node online and answers its group's readiness and pairs."""
    return await _post(router_url, "/Heartbeat", {"node_id": node_id}, client, timeout_s)


async def register_comm_id(router_url: str, node_id: str, comm_key: str, comm_id: str, *,
                           client: httpx2.AsyncClient | None = None,
                           timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """``POST /RegisterCommId`` (prefill rank 0 only): the communicator id of one of its pairs, which the pair's
    decode nodes then read from their heartbeats' ``comm_group_to_id``."""
    return await _post(router_url, "/RegisterCommId", {"node_id": node_id, "comm_key": comm_key, "comm_id": comm_id},
                       client, timeout_s)


async def _post(router_url: str, path: str, payload: dict[str, Any], client: httpx2.AsyncClient | None,
                timeout_s: float) -> dict[str, Any]:
    url = router_url.rstrip("/") + path
    try:
        if client is None:
            async with httpx2.AsyncClient(trust_env=False) as own:
                response = await own.post(url, json=payload, timeout=timeout_s)
        else:
            response = await client.post(url, json=payload, timeout=timeout_s)
    except httpx2.HTTPError as exc:
        raise RouterError(None, f"router at {router_url} did not answer {path}: {type(exc).__name__}: {exc}") \
            from exc
    if not response.is_success:
        message, code = response.text, None
        try:
            error = response.json()["error"]
            message, code = error["message"], error.get("code")
        except (ValueError, KeyError, TypeError):
            pass
        raise RouterError(response.status_code, message, code)
    return response.json()
