"""Real ``ksana router`` processes on loopback, the scripted upstreams, and helpers that register nodes with the
router through ``ksana.router.client`` (the functions a node calls)."""

from __future__ import annotations

import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import httpx2
import trio

from ksana.router import client
from ksana.router.process import RouterProcess
from ksana.server.process import ServeProcess

ECHO_UPSTREAM = Path(__file__).with_name("echo_upstream.py")


def call(fn, *args, **kwargs):
    """Run one of ``ksana.router.client``'s async functions to its end."""
    return trio.run(partial(fn, *args, **kwargs))


def wait_until(probe, condition, timeout_s: float = 10.0, what: str = "condition"):
    """Call ``probe()`` until ``condition(value)`` holds; fail with the last value after the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if condition(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout_s} s: {value}")
        time.sleep(0.02)


class Router(RouterProcess):
    """A router child process with an HTTP client and helpers that play nodes."""

    def __init__(self, *args: str) -> None:
        super().__init__(*args)
        self.http: httpx2.Client | None = None

    def wait_ready(self) -> Router:
        super().wait_ready()
        if self.http is None:
            self.http = httpx2.Client(base_url=self.url, timeout=60, trust_env=False)
        return self

    def register(self, addr: str, role: str, *, rank: int = 0, world_size: int = 1, num_devices: int = 1,
                 coordinator: str | None = None, **extra: Any) -> str:
        body = client.NodeRegistration(
            inference_addr=addr, group_role=role, node_rank=rank, world_size=world_size,
            devices=tuple(client.Device(device_id=i) for i in range(num_devices)),
            coordinator_addr=coordinator or f"{role}-{addr}-{rank}", hostname="localhost", **extra)
        answer = call(client.register_node, self.url, body)
        return answer["node_id"]

    def heartbeat(self, node_id: str) -> dict[str, Any]:
        return call(client.heartbeat, self.url, node_id)

    def pair(self, prefill_addr: str, decode_addr: str) -> tuple[str, str]:
        """Register a one-device prefill and decode node and heartbeat them into an active pair."""
        prefill, decode = self.register(prefill_addr, "prefill"), self.register(decode_addr, "decode")
        self.heartbeat(prefill)
        self.heartbeat(decode)
        return prefill, decode

    def nodes(self) -> dict[str, Any]:
        response = self.http.get("/nodes")
        response.raise_for_status()
        return response.json()

    def node(self, node_id: str) -> dict[str, Any]:
        return next(node for node in self.nodes()["nodes"] if node["node_id"] == node_id)

    def pair_row(self, key: str) -> dict[str, Any] | None:
        return next((pair for pair in self.nodes()["pairs"] if pair["comm_key"] == key), None)

    def close(self) -> None:
        if self.http is not None:
            self.http.close()
        super().close(timeout_s=10)


class EchoUpstream(ServeProcess):
    """``echo_upstream.py NAME``: a scripted upstream that records what the router sends it."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(startup_timeout_s=30)

    def command(self, *args: str) -> list[str]:
        return [sys.executable, "-P", str(ECHO_UPSTREAM), self.name]

    @property
    def addr(self) -> str:
        return self.url.removeprefix("http://")

    def requests(self) -> list[dict[str, Any]]:
        return httpx2.get(self.url + "/requests", trust_env=False).json()

    def tagged(self, tag: str) -> dict[str, Any] | None:
        """The request whose body holds ``tag``, or None when none reached this upstream."""
        return next((r for r in self.requests() if tag in r["body"]), None)

    def release(self, event: str) -> None:
        httpx2.post(self.url + "/release", json={"event": event}, trust_env=False).raise_for_status()
