"""One process, one trio run: hypercorn's trio worker serves the app while the engine's event loop steps.

Shutdown (SIGINT or SIGTERM): the I/O actor refuses new requests and tells every open stream to end with an error
chunk (their requests are aborted, so the scheduler stops working on them), hypercorn stops accepting and waits for
those responses to finish (``graceful_timeout`` at most), then the event loop stops after the step in hand.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator
from functools import partial

import attrs
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from ksana.disagg.kv_connector import KVConnector
from ksana.disagg.node import NodeAgent
from ksana.engine import InferenceEngine
from ksana.generation_config import read_sampling_defaults
from ksana.scheduler.step_log import StepLog
from ksana.server.app import build_app
from ksana.server.context import ServerContext
from ksana.server.io_actor import ServerIOActor
from ksana.server.metrics import ServerMetrics
from ksana.server.priority import DEFAULT_LOOP_NICE, lower_loop_priority
from ksana.server.signals import watch_signals

logger = logging.getLogger(__name__)


@attrs.frozen
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8080  # 0: any free port (the printed URL names it)
    served_model_name: str | None = None  # default: the --model value
    api_key: str | None = None
    graceful_timeout_s: float = 3.0  # how long open responses get to end after a signal
    keep_alive_timeout_s: float = 5.0
    # CPython's GIL switch interval while serving (default 5 ms). The loop thread runs long Python stretches (every
    # stream's chunks, the scheduler) while the forward thread needs the GIL for a moment between native kernels;
    # at 5 ms one stretch can hold the forward that long. 1 ms keeps saturated serving steadier and faster on two
    # cores (`bench/serving_vs_offline.py`).
    switch_interval_s: float = 0.001
    # The event loop thread's nice value above the forward's threads (``priority``; Linux; 0 leaves it): on two
    # cores the forward's threads then win the CPU when both are ready. The default comes from
    # `bench/serving_vs_offline.py`'s saturated serving at nice 0, 10 and 19.
    loop_nice: int = DEFAULT_LOOP_NICE
    # Tokens per streamed event (SGLang's and vLLM's ``--stream-interval``): each event costs the loop one pass
    # through hypercorn, h11 and a socket send (about 100 us of CPU), taken from the forward's cores
    # (`bench/serving_vs_offline.py --stream-interval N`). 1 streams every token as it comes.
    stream_interval: int = 1
    # Sampling defaults for requests that leave fields out (vLLM's ``--generation-config``): "auto" reads the model
    # directory's generation_config.json, "vllm" ignores it, another value is a directory to read it from.
    generation_config: str = "auto"
    step_log: str | None = None  # a JSONL file of every step's shape and times (``ksana.scheduler.step_log``)


def build_context(engine: InferenceEngine, options: ServeOptions) -> ServerContext:
    """The handlers' context; a prefill or decode node also gets its KV transport on the engine's runner."""
    metrics = ServerMetrics()
    tokenization = engine.config.setting.tokenization
    defaults = read_sampling_defaults(engine.model_dir, options.generation_config)
    if defaults:
        logger.warning("sampling defaults from the model's generation config (%s): %s; requests that leave these "
                       "fields out use them (--generation-config vllm ignores them)", options.generation_config,
                       ", ".join(f"{k}={v}" for k, v in defaults.items()))
    else:
        logger.info("no sampling defaults from the model (--generation-config %s)", options.generation_config)
    return ServerContext(
        io=ServerIOActor(metrics),
        metrics=metrics,
        tokenizer=engine.tokenizer,
        served_model_name=options.served_model_name or engine.config.model_spec.base_model.model_dir,
        model_dir=engine.model_dir,
        max_token_len=engine.scheduler.max_token_len,
        vocab_size=engine.shape.vocab_size,
        eos_token_ids=engine.eos_token_ids,
        add_special_tokens=tokenization.add_special_tokens,
        skip_special_tokens=tokenization.skip_special_tokens,
        api_key=options.api_key,
        stream_interval=options.stream_interval,
        node_role=engine.config.setting.connector.group_role,
        default_sampling=defaults,
    )


def _bind(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def serve(engine: InferenceEngine, options: ServeOptions,
                on_ready: Callable[[ServerContext, str], None] | None = None) -> None:
    """Serve until SIGINT/SIGTERM; ``on_ready(ctx, url)`` runs once the socket listens."""
    ctx = build_context(engine, options)
    app = build_app(ctx)
    config = HypercornConfig()
    config.bind = [_bind(options.host, options.port)]
    config.graceful_timeout = options.graceful_timeout_s
    config.keep_alive_timeout = options.keep_alive_timeout_s
    config.errorlog = logging.getLogger("hypercorn.error")  # through our logging setup, not a second handler
    stop = trio.Event()
    agent = _node_agent(engine, options) if ctx.node_role != "none" else None
    ctx.kv_connector = agent.connector if agent is not None else None
    step_log = StepLog(options.step_log) if options.step_log else None
    loop = engine.build_loop(ctx.io, step_log=step_log)
    async with loop.running():
        if await lower_loop_priority(engine.forward_lane, options.loop_nice):
            logger.info("event loop thread at nice +%d", options.loop_nice)
        async with trio.open_nursery() as nursery:
            await nursery.start(watch_signals, stop, nursery.cancel_scope, partial(_begin_shutdown, ctx))

            async def run_http(task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
                await hypercorn_serve(app, config, shutdown_trigger=stop.wait, task_status=task_status)
                nursery.cancel_scope.cancel()  # the HTTP side is done: stop watching signals

            binds = await nursery.start(run_http)
            url = binds[0] if binds else f"http://{config.bind[0]}"
            logger.info("serving %s at %s", ctx.served_model_name, url)
            if agent is not None:
                agent.inference_addr = agent.inference_addr or url.removeprefix("http://")
                nursery.start_soon(agent.run)
            if on_ready is not None:
                on_ready(ctx, url)
    if step_log is not None:
        step_log.close()
    logger.info("server stopped")


def _node_agent(engine: InferenceEngine, options: ServeOptions) -> NodeAgent:
    """A prefill or decode node's KV transport (on the engine's runner, before the loop starts its worker) and
    its agent at the router (the address it registers is the served one unless configured)."""
    connector_setting = engine.config.setting.connector
    tp_size = engine.config.setting.global_.tensor_para_size
    connector = KVConnector(connector_setting.group_role, host=options.host,
                            expire_s=float(connector_setting.connector_waiting_sec), tp_size=tp_size)
    connector.expected_bytes = engine.kv_cache.payload_bytes
    engine.runner.kv_connector = connector
    tp_runner = engine.tp_runner

    async def join(comm_key: str, comm_id: str) -> None:
        if tp_runner is None:
            connector.connect(comm_key, comm_id)
        else:  # every rank, on the forward's thread: its broadcasts are ordered with the steps'
            await engine.forward_lane.run(tp_runner.join_pair, comm_key, comm_id)

    return NodeAgent(role=connector_setting.group_role, router_url=connector_setting.router_addr,
                     inference_addr=connector_setting.inference_addr,
                     cluster_name=connector_setting.cluster_name,
                     heartbeat_interval_s=connector_setting.heartbeat_interval_ms / 1000,
                     connector=connector, join=join, num_devices=tp_size, device_type=engine.device.type)


def _begin_shutdown(ctx: ServerContext, name: str) -> None:
    num_open = ctx.io.begin_shutdown()
    logger.info("%s: shutting down (%d open responses end with an error)", name, num_open)


def run(engine: InferenceEngine, options: ServeOptions,
        on_ready: Callable[[ServerContext, str], None] | None = None) -> None:
    with switch_interval(options.switch_interval_s):
        trio.run(partial(serve, engine, options, on_ready))


@contextlib.contextmanager
def switch_interval(seconds: float) -> Iterator[None]:
    """The interpreter's thread switch interval set to ``seconds`` inside, restored after."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(before)
