"""A prefill or decode node's side of the router: register, heartbeat, and join the pairs the router makes.

The router answers each heartbeat with the node's pairs (``comm_group_to_address``) and their comm ids
(``comm_group_to_id``). A prefill node (rank 0 of its group) gives each of its pairs its KV store's address as
comm id (``/RegisterCommId``) and joins it; a decode node joins each pair whose comm id is known. Joining is
``KVConnector.connect`` on every tensor-parallel rank of the node (``join``): the pair's process group forms on a
thread once both nodes have joined. The router being
away is logged and retried at the next heartbeat; the node keeps serving what it can.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable

import attrs
import httpx2
import trio

from ksana.disagg.kv_connector import KVConnector
from ksana.router import client

logger = logging.getLogger(__name__)
# Each heartbeat is a request: httpx2 logs every one at INFO, which would bury the node's own log.
logging.getLogger("httpx2").setLevel(logging.WARNING)


@attrs.define
class NodeAgent:
    role: str  # "prefill" or "decode"
    router_url: str
    inference_addr: str  # host:port the router sends requests to
    cluster_name: str
    heartbeat_interval_s: float
    connector: KVConnector  # rank 0's
    join: Callable[[str, str], Awaitable[None]]  # (comm key, comm id): every rank of this node joins the pair
    num_devices: int = 1  # tensor-parallel ranks
    device_type: str = "cpu"
    node_id: str | None = None
    comm_ids: dict[str, str] = attrs.field(factory=dict)  # pair -> comm id joined
    http: httpx2.AsyncClient | None = None  # one connection pool for the agent's life (``run``)

    def registration(self) -> client.NodeRegistration:
        """``/RegisterNode``'s body: one node (rank 0) holding every device of its tensor-parallel group."""
        host = self.inference_addr.rsplit(":", 1)[0]
        return client.NodeRegistration(
            inference_addr=self.inference_addr, group_role=self.role, world_size=self.num_devices,
            devices=tuple(client.Device(i, self.device_type, host) for i in range(self.num_devices)),
            cluster_name=self.cluster_name,
            hostname=socket.gethostname(), coordinator_addr=self.inference_addr, job_id=str(os.getpid()),
            start_time=time.strftime("%Y-%m-%d %H:%M:%S"), node_id=self.node_id)

    async def run(self) -> None:
        """Register (retrying while the router is away), then heartbeat until cancelled."""
        async with httpx2.AsyncClient(trust_env=False) as self.http:
            await self._beat_forever()

    async def _beat_forever(self) -> None:
        while True:
            try:
                if self.node_id is None:
                    answer = await client.register_node(self.router_url, self.registration(), client=self.http)
                    self.node_id = answer["node_id"]
                    logger.info("registered with router %s as %s node %s", self.router_url, self.role, self.node_id)
                await self.heartbeat()
            except client.RouterError as exc:
                logger.warning("router %s: %s", self.router_url, exc)
                if exc.status == 404:
                    self.node_id = None  # the router forgot this node (a new database): register again
            await trio.sleep(self.heartbeat_interval_s)

    async def heartbeat(self) -> None:
        answer = await client.heartbeat(self.router_url, self.node_id, client=self.http)
        comm_ids: dict[str, str] = answer.get("comm_group_to_id") or {}
        for comm_key, devices in (answer.get("comm_group_to_address") or {}).items():
            if len(devices) != 2 * self.num_devices:
                logger.warning("pair %s is not joined: it has %d devices, and both nodes of a pair need this "
                               "node's tensor-parallel size (%d)", comm_key, len(devices), self.num_devices)
                continue
            comm_id = comm_ids.get(comm_key) or ""
            if self.role == "prefill" and not comm_id:
                comm_id = self.connector.comm_id()
                await client.register_comm_id(self.router_url, self.node_id, comm_key, comm_id, client=self.http)
            if comm_id and self.comm_ids.get(comm_key) != comm_id:
                logger.info("joining pair %s (comm id %s)", comm_key, comm_id)
                await self.join(comm_key, comm_id)
                self.comm_ids[comm_key] = comm_id
