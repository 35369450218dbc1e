"""``ksana router`` in one trio run: hypercorn serves the app while a sweeper times out silent nodes.

Shutdown (SIGINT or SIGTERM): hypercorn stops accepting and gives open responses ``graceful_timeout_s`` to end; a
second signal stops at once. The database keeps the registry, so a router restarted on it knows every node.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import attrs
import httpx2
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from ksana.router.app import build_app
from ksana.router.policy import POLICIES
from ksana.router.proxy import Proxy
from ksana.router.registry import Registry
from ksana.router.state import RouterState
from ksana.router.storage import Storage
from ksana.server.signals import watch_signals

logger = logging.getLogger(__name__)


@attrs.frozen
class RouterOptions:
    host: str = "127.0.0.1"
    port: int = 9080  # 0: any free port (the printed URL names it)
    db: str = "router.db"  # a SQLite file, or a SQLAlchemy URL (``postgresql://...``, ``mysql+pymysql://...``)
    heartbeat_timeout_s: float = 60.0
    cluster_name: str = "default_cluster"
    policy: str = "random"
    graceful_timeout_s: float = 3.0
    keep_alive_timeout_s: float = 5.0
    connect_timeout_s: float = 10.0  # to reach a node; reads have no timeout (a stream lasts as long as it lasts)

    @property
    def sweep_interval_s(self) -> float:
        """How often the sweeper looks for timed-out nodes: a quarter of the timeout, within [0.05 s, 1 s]."""
        return min(1.0, max(0.05, self.heartbeat_timeout_s / 4))


def _bind(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def serve(options: RouterOptions, on_ready: Callable[[str], None] | None = None) -> None:
    """Serve until SIGINT/SIGTERM; ``on_ready(url)`` runs once the socket listens."""
    if options.policy not in POLICIES:
        raise ValueError(f"unknown policy {options.policy!r} (choose from {', '.join(POLICIES)})")
    storage = await trio.to_thread.run_sync(Storage, options.db)  # connects and creates missing tables
    try:
        state = RouterState(storage, Registry(options.cluster_name, options.heartbeat_timeout_s))
        await state.load()
        timeout = httpx2.Timeout(None, connect=options.connect_timeout_s)
        limits = httpx2.Limits(max_connections=None, max_keepalive_connections=64)
        # trust_env off: nodes are reached directly, never through a proxy named in the environment.
        async with httpx2.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
            proxy = Proxy(client, state, POLICIES[options.policy]())
            config = HypercornConfig()
            config.bind = [_bind(options.host, options.port)]
            config.graceful_timeout = options.graceful_timeout_s
            config.keep_alive_timeout = options.keep_alive_timeout_s
            config.errorlog = logging.getLogger("hypercorn.error")
            stop = trio.Event()
            async with trio.open_nursery() as nursery:
                await nursery.start(watch_signals, stop, nursery.cancel_scope,
                                    lambda name: logger.info("%s: shutting down", name))
                nursery.start_soon(state.sweep_forever, options.sweep_interval_s)

                async def run_http(task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
                    await hypercorn_serve(build_app(state, proxy), config, shutdown_trigger=stop.wait,
                                          task_status=task_status)
                    nursery.cancel_scope.cancel()  # the HTTP side is done: stop sweeping and watching signals

                binds = await nursery.start(run_http)
                url = binds[0] if binds else f"http://{config.bind[0]}"
                logger.info("router for cluster %s at %s (database %s, policy %s, %d routable pairs)",
                            options.cluster_name, url, storage.engine.url.render_as_string(), options.policy,
                            len(state.routes))
                if on_ready is not None:
                    on_ready(url)
    finally:
        storage.close()
    logger.info("router stopped")


def run(options: RouterOptions, on_ready: Callable[[str], None] | None = None) -> None:
    trio.run(partial(serve, options, on_ready))
