"""``ksana router``: KsanaLLM's Simple Router (node registry and prefill/decode proxy)."""

from __future__ import annotations

import argparse

from ksana.router.policy import POLICIES


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"takes a number of seconds above 0, not {text!r}")
    return value


def add_router_parser(subparsers) -> None:
    router = subparsers.add_parser("router", help="the Simple Router: registers prefill and decode nodes, pairs "
                                                  "them, and proxies requests to a pair")
    router.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    router.add_argument("--port", type=int, default=9080, help="port (default 9080; 0 picks a free one)")
    router.add_argument("--db", default="router.db",
                        help="a SQLite file (default router.db) or a SQLAlchemy URL (postgresql://..., "
                             "mysql+pymysql://...; its driver installed)")
    router.add_argument("--heartbeat-timeout", type=_positive_seconds, default=60.0, metavar="SECONDS",
                        help="a node whose last heartbeat is older is offline (default 60)")
    router.add_argument("--cluster-name", default="default_cluster",
                        help="the cluster nodes must name to register (default default_cluster)")
    router.add_argument("--policy", choices=sorted(POLICIES), default="random",
                        help="how a request's pair is chosen among the routable ones (default random, as KsanaLLM)")
    router.set_defaults(func=_cmd_router)


def _cmd_router(args: argparse.Namespace) -> int:
    from ksana.router.serve import RouterOptions, run
    from ksana.server.cli import serve_until_stopped

    options = RouterOptions(host=args.host, port=args.port, db=args.db, heartbeat_timeout_s=args.heartbeat_timeout,
                            cluster_name=args.cluster_name, policy=args.policy)
    return serve_until_stopped(lambda: run(options, lambda url: print(f"Ksana router at {url}", flush=True)),
                               args.host, args.port)
