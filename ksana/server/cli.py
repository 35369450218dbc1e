"""``ksana serve``: its argument parser and entry point (filled in by the server issue)."""

from __future__ import annotations

import argparse


def add_serve_parser(subparsers, add_config_flags) -> None:
    serve = subparsers.add_parser("serve", help="serve the OpenAI-compatible API (not implemented yet)")
    add_config_flags(serve)
    serve.set_defaults(func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    raise NotImplementedError("ksana serve is not implemented yet")
