"""The router's state as the HTTP side sees it: registry calls run on the storage thread, and a snapshot of the
routable pairs that the proxy reads without touching the database.

Every registry call refreshes the snapshot inside its own transaction, and a sweeper marks timed-out nodes
offline between heartbeats, so a request never waits on the database and a snapshot is never older than the last
change this router made (or the last sweep, for changes another router made to a shared database).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import attrs
import trio
from sqlalchemy.orm import Session

from ksana.router.protocol import RegisterCommIdRequest, RegisterNodeRequest
from ksana.router.registry import Registry, Route
from ksana.router.storage import Storage

logger = logging.getLogger(__name__)

T = TypeVar("T")


@attrs.define(eq=False)
class RouterState:
    storage: Storage
    registry: Registry
    routes: list[Route] = attrs.field(factory=list)

    async def load(self) -> None:
        """Read the snapshot (a router restarted on its database knows its nodes and pairs at once)."""
        await self._call(self.registry.sweep)

    async def register_node(self, req: RegisterNodeRequest) -> dict[str, Any]:
        answer = await self._call(self.registry.register_node, req)
        logger.info("registered %s node %s at %s rank %d", req.group_role, answer["node_id"], req.inference_addr,
                    req.node_rank)
        return answer

    async def heartbeat(self, node_id: str) -> dict[str, Any]:
        return await self._call(self.registry.heartbeat, node_id)

    async def register_comm_id(self, req: RegisterCommIdRequest) -> dict[str, Any]:
        answer = await self._call(self.registry.register_comm_id, req)
        logger.info("comm id of %s registered by node %s", req.comm_key, req.node_id)
        return answer

    async def nodes(self) -> dict[str, Any]:
        return await self.storage.run(self.registry.nodes)

    async def sweep_forever(self, interval_s: float) -> None:
        """Mark nodes offline once their heartbeat times out, even when no other node calls in."""
        while True:
            await trio.sleep(interval_s)
            try:
                if await self._call(self.registry.sweep):
                    logger.info("heartbeat timeout: %d routable pairs left", len(self.routes))
            except Exception:  # a database hiccup must not stop the sweeps; the next one retries
                logger.exception("sweep failed")

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        def work(session: Session) -> tuple[T, list[Route]]:
            result = fn(session, *args)
            session.flush()
            return result, self.registry.routes(session)

        result, self.routes = await self.storage.run(work)
        return result
