"""``ksana perf``: its argument parser and entry point (filled in by the perf-mode issue)."""

from __future__ import annotations

import argparse


def add_perf_parser(subparsers) -> None:
    perf = subparsers.add_parser("perf", help="replay fixed batches and write latency JSON (not implemented yet)")
    perf.add_argument("--config", default="model_perf_config.json")
    perf.set_defaults(func=_cmd_perf)


def _cmd_perf(args: argparse.Namespace) -> int:
    raise NotImplementedError("ksana perf is not implemented yet")
