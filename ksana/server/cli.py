"""``ksana serve`` (the OpenAI-compatible server) and ``ksana bench serve`` (its load generator)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from ksana.config_flags import add_config_flags, config_overrides
from ksana.server.priority import DEFAULT_LOOP_NICE, parse_loop_nice

# YAML keys beyond the shared config flags, as ``--flag`` -> config leaf name.
_EXTRA_CONFIG_FLAGS = {
    "max_token_len": int,
    "max_waiting_queue_len": int,
    "waiting_timeout_in_ms": int,
    "block_device_memory_ratio": float,
    "num_threads": int,
    "tensor_para_size": int,
    "inference_addr": str,
    "cluster_name": str,
    "heartbeat_interval_ms": int,
    "connector_waiting_sec": int,
}


def parse_stream_interval(text: str) -> int:
    """argparse's ``type`` for ``--stream-interval``: a positive int, or a message that names the flag."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"takes a whole number of tokens, at least 1, not {text!r}")
    return value


def add_serve_parser(subparsers) -> None:
    serve = subparsers.add_parser("serve", help="serve the OpenAI-compatible API and KsanaLLM's /generate")
    add_config_flags(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 picks a free one)")
    serve.add_argument("--served-model-name", help="the model name clients send (default: the --model value)")
    serve.add_argument("--api-key", default=os.environ.get("KSANA_API_KEY"),
                       help="require 'Authorization: Bearer KEY' (default: $KSANA_API_KEY, else no key)")
    serve.add_argument("--device", choices=["auto", "cpu", "cuda", "npu"])
    serve.add_argument("--loop-nice", type=parse_loop_nice, default=DEFAULT_LOOP_NICE, metavar="0-19",
                       help="how much lower the event loop thread's priority is than the forward pass's threads "
                            f"(Linux; default {DEFAULT_LOOP_NICE}, 0 leaves it)")
    serve.add_argument("--stream-interval", type=parse_stream_interval, default=1, metavar="N",
                       help="send a stream's tokens N at a time (fewer events, less CPU per token; default 1)")
    serve.add_argument("--role", choices=["none", "prefill", "decode"], dest="group_role",
                       help="a node of a prefill/decode pair, registered with --router (default: standalone)")
    serve.add_argument("--router", dest="router_addr", metavar="URL",
                       help="the ksana router a prefill or decode node registers with")
    serve.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                       help="sampling defaults for requests that leave them out: 'auto' (default) reads the model's "
                            "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, "
                            "max_new_tokens), 'vllm' ignores it, a directory reads its generation_config.json")
    serve.add_argument("--step-log", metavar="FILE",
                       help="write one JSON line per step: its rows, when it was planned, ran and ended (what "
                            "'ksana simulate calibrate' fits serving's costs from)")
    for name, kind in _EXTRA_CONFIG_FLAGS.items():
        serve.add_argument("--" + name.replace("_", "-"), type=kind, dest=name)
    serve.set_defaults(func=_cmd_serve)
    _add_bench_parser(subparsers)


def _cmd_serve(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from ksana.config import load_config
    from ksana.engine import InferenceEngine
    from ksana.generation_config import read_sampling_defaults
    from ksana.server.serve import ServeOptions, run

    overrides = config_overrides(args) | {name: getattr(args, name) for name in _EXTRA_CONFIG_FLAGS}
    overrides |= {"group_role": args.group_role, "router_addr": args.router_addr}
    config = load_config(args.config, model_dir=args.model, device=args.device, **overrides)
    engine = InferenceEngine(config)
    read_sampling_defaults(engine.model_dir, args.generation_config)  # a bad file is a CLI error, before serving
    options = ServeOptions(host=args.host, port=args.port, served_model_name=args.served_model_name,
                           api_key=args.api_key or None, loop_nice=args.loop_nice,
                           stream_interval=args.stream_interval, generation_config=args.generation_config,
                           step_log=args.step_log)

    def on_ready(ctx, url: str) -> None:
        print(f"Ksana serving {ctx.served_model_name} at {url}", flush=True)

    return serve_until_stopped(lambda: run(engine, options, on_ready), args.host, args.port)


def serve_until_stopped(run: Callable[[], None], host: str, port: int) -> int:
    """Run a server (``ksana serve``, ``ksana router``) to its end: 0, or 2 and one line on stderr when its address
    cannot be bound."""
    try:
        run()
    except BaseException as exc:
        error = _first(exc, OSError)
        if error is None:
            raise
        print(f"ksana: error: cannot serve on {host}:{port}: {error}", file=sys.stderr)
        return 2
    return 0


def _first(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    """The first ``kind`` in an exception (group) tree: trio reports a failed bind inside nursery groups."""
    if isinstance(exc, kind):
        return exc
    for inner in getattr(exc, "exceptions", ()):
        found = _first(inner, kind)
        if found is not None:
            return found
    return None


def _add_bench_parser(subparsers) -> None:
    """``ksana bench serve``: the load generator (``ksana.bench.serve``)."""
    from ksana.bench import serve as load_generator

    bench = subparsers.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    serve = bench_sub.add_parser("serve", help="online load generator against a running server (vLLM's metrics)")
    load_generator.add_arguments(serve)
    serve.set_defaults(func=load_generator.run)
