"""Bodies of the node-facing routes and the coordination headers, in KsanaLLM's names.

Validated like the server's bodies (``ksana.server.protocol.parse_body``): strict types, unknown fields ignored,
and every failure a 400 that names the field, in OpenAI's error form.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

# The headers the router adds to both halves of a request (KsanaLLM's names).
KV_COMM_GROUP_KEY = "kv-comm-group-key"  # the pair's comm key
KV_COMM_REQUEST_ID = "kv-comm-request-id"  # a positive 31-bit id shared by the two halves of one request
REMOTE_IP = "x-remote-ip"  # the client's address
KEY_SEPARATOR = "__"


def comm_key(prefill_addr: str, decode_addr: str) -> str:
    """A pair's key: ``"<prefill_addr>__<decode_addr>"``."""
    return f"{prefill_addr}{KEY_SEPARATOR}{decode_addr}"


def split_comm_key(key: str) -> tuple[str, str] | None:
    """``(prefill_addr, decode_addr)`` of a pair's key, or None when it is not one."""
    prefill_addr, sep, decode_addr = key.partition(KEY_SEPARATOR)
    return (prefill_addr, decode_addr) if sep and prefill_addr and decode_addr else None


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class DeviceInfo(_Strict):
    device_id: int
    device_type: str = ""
    device_ip: str = ""


class RegisterNodeRequest(_Strict):
    inference_addr: str  # "host:port" of the group's HTTP server (rank 0's), the address requests go to
    group_role: Literal["prefill", "decode"]
    world_size: int  # devices in the whole group
    devices: list[DeviceInfo]  # this node's devices
    cluster_name: str = "default_cluster"
    node_rank: int = 0
    hostname: str = ""
    coordinator_addr: str = ""  # bare "IP:port" of this node's control channel
    job_id: str | None = None
    start_time: str | int | float | None = None
    comm_id: str | None = None
    node_id: str | None = None  # given on a re-registration to keep the id; new nodes get a uuid4 hex


class HeartbeatRequest(_Strict):
    node_id: str


class RegisterCommIdRequest(_Strict):
    node_id: str
    comm_key: str  # "<prefill_addr>__<decode_addr>"
    comm_id: str
