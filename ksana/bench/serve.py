"""Online load generator against a running server, with vLLM's ``bench serve`` metric definitions.

    python bench/serve.py --base-url http://127.0.0.1:8080 --num-prompts 32 --input-len 32:256 --output-len 16:128
    ksana bench serve --base-url URL --request-rate 4 --burstiness 1 --max-concurrency 16 --goodput ttft:500 tpot:50
    ksana bench serve --base-url URL --dataset trace.jsonl     # replay a JSONL dataset (prompt text or ids)
    ksana bench serve --base-url URL --trace trace.jsonl       # replay the simulator's trace (ksana.bench.trace)

Per request (streamed): TTFT = send to first streamed chunk with tokens; ITL = every gap between such chunks;
TPOT = (E2EL - TTFT) / (output tokens - 1); E2EL = send to the last byte. Totals: request, output and total token
throughput over the benchmark's duration, and goodput (requests/s meeting every ``--goodput`` SLO in ms).
Arrivals: all at once (``--request-rate inf``, the default) or at ``--request-rate`` per second with gaps drawn from a
gamma distribution of shape ``--burstiness`` (1 = Poisson), capped at ``--max-concurrency`` requests in flight.
Datasets: ``random`` (seeded; token-id prompts whose lengths are drawn from the ``--input-len`` range, each asking for
an ``--output-len`` drawn from its range, with ``ignore_eos`` so it gets exactly that) or a JSONL trace with one
request per line: ``prompt`` (text) or ``prompt_token_ids``, ``output_len`` (or ``max_tokens``), and optionally
``timestamp`` (seconds from the start; the trace's arrival times then replace ``--request-rate``).
It prints a table and writes JSON with the totals and every request's timings (the simulator's ground truth).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import orjson

from ksana.bench.results import write_json
from ksana.bench.trace import arrival_times

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/generate")
METRICS = ("ttft", "tpot", "itl", "e2el")


@attrs.define
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int
    output_len: int
    timestamp: float | None = None


@attrs.define
class RequestResult:
    prompt_len: int
    output_len: int = 0
    send_time: float = 0.0  # seconds from the benchmark's start
    ttft: float = 0.0
    itl: list[float] = attrs.field(factory=list)
    e2el: float = 0.0
    success: bool = False
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.e2el - self.ttft) / (self.output_len - 1) if self.output_len > 1 else None


# ---- workload ---------------------------------------------------------------------------------------------------
def parse_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    low_i, high_i = int(low), int(high or low)
    if not 1 <= low_i <= high_i:
        raise argparse.ArgumentTypeError(f"expected N or LOW:HIGH with 1 <= LOW <= HIGH, got {text!r}")
    return low_i, high_i


def random_dataset(num: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int,
                   seed: int) -> list[BenchRequest]:
    """Token-id prompts (exact lengths), skipping the low ids where special and byte tokens live."""
    rng = random.Random(seed)
    low = 256 if vocab_size > 1024 else 3
    requests = []
    for _ in range(num):
        n = rng.randint(*input_len)
        requests.append(BenchRequest([rng.randrange(low, vocab_size) for _ in range(n)], n, rng.randint(*output_len)))
    return requests


def trace_dataset(path: Path, limit: int | None) -> list[BenchRequest]:
    requests = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = orjson.loads(line)
        prompt = row.get("prompt_token_ids", row.get("prompt"))
        if prompt is None:
            raise ValueError(f"{path}:{number}: needs prompt or prompt_token_ids")
        output_len = row.get("output_len", row.get("max_tokens"))
        if output_len is None:
            raise ValueError(f"{path}:{number}: needs output_len or max_tokens")
        prompt_len = len(prompt) if isinstance(prompt, list) else row.get("prompt_len", 0)
        requests.append(BenchRequest(prompt, prompt_len, int(output_len), row.get("timestamp")))
    return requests[:limit] if limit else requests


def trace_requests(path: Path, vocab_size: int, seed: int) -> list[BenchRequest]:
    """A trace (``ksana.bench.trace``) as requests with the same prompt ids the simulator gives them."""
    from ksana.bench.trace import prompt_ids, read_trace

    return [BenchRequest(prompt_ids(r, i, vocab_size, seed), r.prompt_len, r.output_len, r.arrival_time_s)
            for i, r in enumerate(read_trace(path))]


# ---- one request ------------------------------------------------------------------------------------------------
def request_body(endpoint: str, model: str, req: BenchRequest, ignore_eos: bool) -> dict[str, Any]:
    if endpoint == "/generate":
        key = "input_tokens" if isinstance(req.prompt, list) else "prompt"
        return {key: req.prompt, "stream": True, "sampling_config": {
            "max_new_tokens": req.output_len, "ignore_eos": ignore_eos}}
    body: dict[str, Any] = {"model": model, "max_tokens": req.output_len, "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
    if endpoint == "/v1/chat/completions":
        return body | {"messages": [{"role": "user", "content": req.prompt}]}
    return body | {"prompt": req.prompt}


@attrs.frozen
class Target:
    """Where the streamed requests go: ``--base-url``'s host, port and path prefix, and the headers every request
    carries."""

    host: str
    port: int
    prefix: str
    headers: tuple[tuple[str, str], ...]

    @classmethod
    def parse(cls, base_url: str, api_key: str | None = None) -> Target:
        from urllib.parse import urlsplit

        url = urlsplit(base_url)
        if url.scheme != "http" or not url.hostname:
            raise SystemExit(f"--base-url must be http://HOST[:PORT][/PATH], got {base_url!r}")
        netloc = url.netloc.rsplit("@", 1)[-1]
        headers = [("Host", netloc), ("Content-Type", "application/json"), ("Accept", "text/event-stream")]
        if api_key:
            headers.append(("Authorization", f"Bearer {api_key}"))
        return cls(url.hostname, url.port or 80, url.path.rstrip("/"), tuple(headers))


async def stream_post(target: Target, path: str, body: bytes):
    """POST ``body`` on a connection of its own; yields the status, then each piece of the body as it comes.

    A load generator shares the host with the server it measures, so its CPU per streamed event is taken from
    the server: this is h11 over a trio socket, without httpx2's per-read timeout scopes and exception mapping
    (about a third of the generator's CPU per event). ``Connection: close``: no pool to manage; a connection's
    set-up is tiny next to a streamed response.
    """
    import h11
    import trio

    connection = h11.Connection(h11.CLIENT)
    headers = [*target.headers, ("Content-Length", str(len(body))), ("Connection", "close")]
    stream = await trio.open_tcp_stream(target.host, target.port)
    async with stream:
        await stream.send_all(connection.send(h11.Request(method="POST", target=target.prefix + path,
                                                          headers=headers))
                              + connection.send(h11.Data(data=body)) + connection.send(h11.EndOfMessage()))
        while True:
            event = connection.next_event()
            if event is h11.NEED_DATA:
                connection.receive_data(await stream.receive_some(1 << 16))
            elif isinstance(event, h11.Response):
                yield event.status_code
            elif isinstance(event, h11.Data):
                yield bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionError("the server closed the connection before the response ended")


async def send_one(target: Target, endpoint: str, body: dict[str, Any], result: RequestResult, start: float,
                   timeout_s: float, scheduled: float | None = None) -> None:
    """Stream one request into ``result``. Latencies count from ``scheduled`` (a trace's arrival time, so a
    request held back by ``--max-concurrency`` counts its wait, as a user's would) or else from the send."""
    import trio

    sent = time.perf_counter()
    result.send_time = sent - start
    if scheduled is not None:
        sent = scheduled
    last = sent
    num_tokens = 0
    usage_tokens = None
    try:
        with trio.fail_after(timeout_s):
            response = stream_post(target, endpoint, orjson.dumps(body))
            async with contextlib.aclosing(response):
                status = await anext(response)
                if status != 200:
                    text = b"".join([data async for data in response])
                    result.error = f"HTTP {status}: {text[:300]!r}"
                    return
                separator = b"\0" if endpoint == "/generate" else b"\n\n"
                buffer = b""
                async for data in response:
                    buffer += data
                    *events, buffer = buffer.split(separator)
                    now = time.perf_counter()
                    for event in events:
                        kind, value = parse_event(endpoint, event)
                        if kind == "error":
                            result.error = value
                            return
                        if kind == "usage":
                            usage_tokens = value
                        elif kind == "tokens":
                            total = value if endpoint == "/generate" else num_tokens + value
                            if total > num_tokens:
                                if num_tokens == 0:
                                    result.ttft = now - sent
                                else:
                                    result.itl.append(now - last)
                                last = now
                                num_tokens = total
        result.e2el = time.perf_counter() - sent
        result.output_len = usage_tokens if usage_tokens is not None else num_tokens
        result.success = num_tokens > 0
        if not result.success:
            result.error = "no tokens streamed"
    except trio.TooSlowError:
        result.error = f"timed out after {timeout_s:g} s"
    except Exception as exc:  # a benchmark reports failures; it does not stop on them
        result.error = f"{type(exc).__name__}: {exc}"


def parse_event(endpoint: str, event: bytes) -> tuple[str | None, Any]:
    """One streamed event as ("tokens", n) (cumulative for /generate), ("usage", n), ("error", msg) or (None, _).

    On the OpenAI routes every chunk that carries a choice (other than chat's opening role chunk) is one step's
    token, even when its text is empty (bytes of a character held back); ``usage`` gives the exact count.
    """
    if endpoint == "/generate":
        if not event.strip():
            return None, None
        data = orjson.loads(event)
        if "error" in data:
            return "error", str(data["error"].get("message"))
        return "tokens", len(data["output_token_ids"][0])
    line = event.strip()
    if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
        return None, None
    data = orjson.loads(line[5:].strip())
    if "error" in data:
        return "error", str(data["error"].get("message"))
    choices = data.get("choices") or []
    if not choices:
        usage = data.get("usage")
        return ("usage", usage["completion_tokens"]) if usage else (None, None)
    if "role" in (choices[0].get("delta") or {}):
        return None, None
    return "tokens", 1


# ---- the run ----------------------------------------------------------------------------------------------------
@attrs.frozen
class BenchRun:
    """One run's results, its duration, and when it started on ``time.monotonic()`` (a server's ``--step-log``
    clock: a trace request's scheduled arrival is ``started_at + arrival_time_s`` on it)."""

    results: list[RequestResult]
    duration: float
    started_at: float


async def benchmark(args: argparse.Namespace, requests: list[BenchRequest], model: str) -> BenchRun:
    import trio

    if any(r.timestamp is not None for r in requests):
        times = [r.timestamp or 0.0 for r in requests]
    else:
        times = arrival_times(len(requests), args.request_rate, args.burstiness, args.seed)
    results = [RequestResult(prompt_len=r.prompt_len) for r in requests]
    limit = args.max_concurrency or len(requests)
    semaphore = trio.Semaphore(limit)
    target = Target.parse(args.base_url, args.api_key)
    start, started_at = time.perf_counter(), time.monotonic()
    trio_start = trio.current_time()

    from_arrival = getattr(args, "trace", None) is not None

    async def one(i: int) -> None:
        async with semaphore:
            body = request_body(args.endpoint, model, requests[i], args.ignore_eos)
            await send_one(target, args.endpoint, body, results[i], start, args.timeout,
                           scheduled=start + times[i] if from_arrival else None)

    async with trio.open_nursery() as nursery:
        for i, at in enumerate(times):
            await trio.sleep_until(trio_start + at)
            nursery.start_soon(one, i)
    return BenchRun(results, time.perf_counter() - start, started_at)


def summarize(args: argparse.Namespace, requests: list[BenchRequest], results: list[RequestResult],
              duration: float, model: str) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_len for r in ok)
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.e2el for r in ok],
    }
    slos = dict(args.goodput or [])
    good = [r for r in ok if all(_meets(r, name, ms) for name, ms in slos.items())]
    summary: dict[str, Any] = {
        "base_url": args.base_url, "endpoint": args.endpoint, "model": model,
        "num_prompts": len(requests), "request_rate": args.request_rate, "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency, "dataset": getattr(args, "trace", None) or args.dataset,
        "seed": args.seed,
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": total_input, "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration, "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "goodput_slos_ms": slos or None, "request_goodput": len(good) / duration if slos else None,
    }
    for name in METRICS:
        values_ms = [v * 1000 for v in series[name]]
        summary[f"mean_{name}_ms"] = statistics.fmean(values_ms) if values_ms else 0.0
        summary[f"median_{name}_ms"] = statistics.median(values_ms) if values_ms else 0.0
        summary[f"std_{name}_ms"] = statistics.pstdev(values_ms) if values_ms else 0.0
        for p in args.metric_percentiles:
            summary[f"p{_pct_name(p)}_{name}_ms"] = _percentile(values_ms, p)
    summary["errors"] = sorted({r.error for r in results if r.error})[:10]
    summary["requests"] = [attrs.asdict(r) | {"tpot": r.tpot} for r in results]
    return summary


def _meets(result: RequestResult, name: str, ms: float) -> bool:
    if name == "ttft":
        return result.ttft * 1000 <= ms
    if name == "e2el":
        return result.e2el * 1000 <= ms
    tpot = result.tpot
    return tpot is None or tpot * 1000 <= ms


def _percentile(values: list[float], p: float) -> float:
    """numpy's default (linear interpolation between closest ranks)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _pct_name(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def print_table(s: dict[str, Any], percentiles: list[float]) -> None:
    width = 50
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=width, c="="))
    rows = [
        ("Successful requests:", s["completed"], "d"),
        ("Failed requests:", s["failed"], "d"),
        ("Benchmark duration (s):", s["duration"], ".2f"),
        ("Total input tokens:", s["total_input_tokens"], "d"),
        ("Total generated tokens:", s["total_output_tokens"], "d"),
        ("Request throughput (req/s):", s["request_throughput"], ".2f"),
    ]
    if s["request_goodput"] is not None:
        rows.append(("Request goodput (req/s):", s["request_goodput"], ".2f"))
    rows += [("Output token throughput (tok/s):", s["output_throughput"], ".2f"),
             ("Total token throughput (tok/s):", s["total_token_throughput"], ".2f")]
    for label, value, fmt in rows:
        print(f"{label:<40}{value:<10{fmt}}")
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for name in METRICS:
        print("{s:{c}^{n}}".format(s=titles[name], n=width, c="-"))
        print(f"{'Mean ' + name.upper() + ' (ms):':<40}{s[f'mean_{name}_ms']:<10.2f}")
        print(f"{'Median ' + name.upper() + ' (ms):':<40}{s[f'median_{name}_ms']:<10.2f}")
        for p in percentiles:
            key = f"p{_pct_name(p)}_{name}_ms"
            print(f"{'P' + _pct_name(p) + ' ' + name.upper() + ' (ms):':<40}{s[key]:<10.2f}")
    print("=" * width)
    for error in s["errors"]:
        print(f"error: {error}", file=sys.stderr)


# ---- command line -----------------------------------------------------------------------------------------------
def _slo(text: str) -> tuple[str, float]:
    name, _, value = text.partition(":")
    if name not in ("ttft", "tpot", "e2el") or not value:
        raise argparse.ArgumentTypeError(f"expected ttft:MS, tpot:MS or e2el:MS, got {text!r}")
    return name, float(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8080", help="server root (default %(default)s)")
    parser.add_argument("--endpoint", choices=ENDPOINTS, default="/v1/completions")
    parser.add_argument("--model", help="model name to send (default: the server's first /v1/models entry)")
    parser.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--dataset", default="random", help="'random' or a JSONL dataset file")
    parser.add_argument("--trace", help="a JSONL trace (arrival_time_s, prompt_len, output_len[, prompt_token_ids]): "
                                        "each request sent at its arrival, latencies counted from it")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--input-len", type=parse_range, default=(32, 256), help="random prompt lengths, N or LOW:HIGH")
    parser.add_argument("--output-len", type=parse_range, default=(16, 128), help="random output lengths, N or LOW:HIGH")
    parser.add_argument("--vocab-size", type=int, help="random token ids below this (default: the server's)")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 is Poisson")
    parser.add_argument("--max-concurrency", type=int, help="most requests in flight")
    parser.add_argument("--goodput", type=_slo, nargs="+", help="SLOs in ms: ttft:500 tpot:50 e2el:2000")
    parser.add_argument("--metric-percentiles", type=lambda s: [float(p) for p in s.split(",")],
                        default=[90.0, 99.0], help="comma-separated (default 90,99)")
    parser.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                        help="let requests stop at EOS (default: ignore_eos, so each gets its output length)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    parser.add_argument("--result-file", default="serve.json", help="result JSON (default %(default)s, in the "
                                                                   "current directory)")


def server_info(args: argparse.Namespace) -> dict[str, Any]:
    import httpx2

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    response = httpx2.get(args.base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]


def replay_trace(base_url: str, trace: Path, seed: int = 0,
                 percentiles: tuple[float, ...] = (90.0, 99.0)) -> dict[str, Any]:
    """Replay a trace against a running server, as ``ksana bench serve --trace`` does; its summary, with the
    run's start on the step log's clock (``start_monotonic_s``)."""
    import trio

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--base-url", base_url, "--trace", str(trace), "--seed", str(seed),
                              "--metric-percentiles", ",".join(str(p) for p in percentiles)])
    info = server_info(args)
    requests = trace_requests(trace, info.get("vocab_size") or 1000, seed)
    run = trio.run(benchmark, args, requests, info["id"])
    return summarize(args, requests, run.results, run.duration, info["id"]) | {"start_monotonic_s": run.started_at}


def run(args: argparse.Namespace) -> int:
    import logging

    import trio

    for name in ("httpx2", "httpcore2"):  # one log line per request would drown the table
        logging.getLogger(name).setLevel(logging.WARNING)

    if args.burstiness <= 0:
        raise SystemExit("--burstiness must be positive")
    Target.parse(args.base_url)  # a bad --base-url is a message, before any request
    info = server_info(args)
    model = args.model or info["id"]
    if args.trace is not None:
        requests = trace_requests(Path(args.trace), info.get("vocab_size") or 1000, args.seed)
    elif args.dataset == "random":
        vocab = args.vocab_size or info.get("vocab_size") or 1000
        requests = random_dataset(args.num_prompts, args.input_len, args.output_len, vocab, args.seed)
    else:
        requests = trace_dataset(Path(args.dataset), args.num_prompts)
    if args.endpoint == "/v1/chat/completions":
        requests = [attrs.evolve(r, prompt=_as_text(args, r.prompt)) for r in requests]
    run = trio.run(benchmark, args, requests, model)
    summary = summarize(args, requests, run.results, run.duration, model)
    print_table(summary, args.metric_percentiles)
    write_json(summary, args.result_file, options=orjson.OPT_SERIALIZE_NUMPY)
    return 0 if summary["completed"] else 1


def _as_text(args: argparse.Namespace, prompt: str | list[int]) -> str:
    """Chat needs text: token-id prompts are decoded by the server's /detokenize."""
    if isinstance(prompt, str):
        return prompt
    import httpx2

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    response = httpx2.post(args.base_url.rstrip("/") + "/detokenize", json={"tokens": prompt}, headers=headers)
    response.raise_for_status()
    return response.json()["prompt"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
