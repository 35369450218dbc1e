"""Prefill/decode disaggregation against a standalone server: one trace, replayed by the load generator against
``ksana serve`` and then through ``ksana router`` in front of a prefill and a decode node (all on this machine).

TTFT, TPOT, ITL and output throughput of both, and the K/V transfer per request (bytes and ms of the prefill
node's sends, from its ``/metrics``). On one small machine the pair's two engines and the router share the cores
with the client, so this measures what disaggregation costs, not what it buys across machines.

    python bench/pd_serving.py            # smollm2: 32 requests at 2/s, prompts 128-512, outputs 32-128
    python bench/pd_serving.py --quick    # the demo model, 8 requests

Writes ``bench/results/pd_serving_<machine kind>.json``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx2  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from ksana.bench.results import machine_info, write_json  # noqa: E402
from ksana.bench.serve import replay_trace  # noqa: E402
from ksana.bench.trace import synthetic_trace, write_trace  # noqa: E402
from ksana.router.process import RouterProcess  # noqa: E402
from ksana.server.process import ServeProcess  # noqa: E402

RESULTS = Path(__file__).parent / "results"
STARTUP_TIMEOUT_S = 600.0
WORKLOAD = {"num": 32, "rate": 2.0, "input_len": (128, 512), "output_len": (32, 128)}
QUICK = {"num": 8, "rate": 4.0, "input_len": (32, 128), "output_len": (8, 16)}
METRICS = ("median_ttft_ms", "p90_ttft_ms", "median_tpot_ms", "median_itl_ms", "median_e2el_ms", "output_throughput")


def scrape(url: str) -> dict[str, float]:
    text = httpx2.get(url + "/metrics", timeout=30).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def wait_connected(nodes: list[ServeProcess], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(scrape(node.url).get("kv_transfer_pair_num") == 1 for node in nodes):
        if time.monotonic() > deadline:
            raise RuntimeError("the prefill/decode pair did not connect")
        time.sleep(0.1)


def run(model: str, workload: dict[str, Any], flags: list[str], work: Path) -> dict[str, Any]:
    trace = write_trace(work / "trace.jsonl", synthetic_trace(workload["num"], workload["rate"],
                                                              workload["input_len"], workload["output_len"], 1.0, 5))
    print("standalone ...", flush=True)
    with ServeProcess("--model", model, *flags, startup_timeout_s=STARTUP_TIMEOUT_S) as server:
        standalone = replay_trace(server.url, trace)
    print("router + prefill + decode ...", flush=True)
    with RouterProcess("--db", str(work / "router.db")) as router:
        node_flags = ["--model", model, *flags, "--router", router.url, "--heartbeat-interval-ms", "500"]
        with ServeProcess(*node_flags, "--role", "prefill", startup_timeout_s=STARTUP_TIMEOUT_S) as prefill, \
                ServeProcess(*node_flags, "--role", "decode", startup_timeout_s=STARTUP_TIMEOUT_S) as decode:
            wait_connected([prefill, decode])
            disaggregated = replay_trace(router.url, trace)
            sent = scrape(prefill.url)
    num = max(1.0, sent["kv_transfer_sent_num"])
    transfer = {"requests": int(sent["kv_transfer_sent_num"]), "bytes_per_request": sent["kv_transfer_sent_bytes"] / num,
                "ms_per_request": 1000 * sent["kv_transfer_send_seconds"] / num}
    return {"standalone": {k: standalone[k] for k in METRICS}, "disaggregated": {k: disaggregated[k] for k in METRICS},
            "kv_transfer": transfer, "completed": [standalone["completed"], disaggregated["completed"]]}


def format_table(result: dict[str, Any]) -> str:
    lines = [f"{'metric':<22}{'standalone':>12}{'router+P/D':>12}{'ratio':>8}"]
    for key in METRICS:
        a, b = result["standalone"][key], result["disaggregated"][key]
        lines.append(f"{key:<22}{a:>12.1f}{b:>12.1f}{b / a if a else float('nan'):>8.2f}")
    t = result["kv_transfer"]
    lines.append(f"KV transfer: {t['requests']} requests, {t['bytes_per_request'] / 2**20:.2f} MiB and "
                 f"{t['ms_per_request']:.2f} ms per request")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="default smollm2 (demo with --quick)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    model = args.model or ("demo" if args.quick else "smollm2")
    workload = QUICK if args.quick else WORKLOAD
    kind = "quick" if args.quick else machine_info()["kind"]
    out = Path(args.out or RESULTS / f"pd_serving_{kind}.json")
    result = run(model, workload, ["--dtype", "float32"] if model == "demo" else [],
                 Path(tempfile.mkdtemp(prefix="pd-serving-")))
    print(format_table(result))
    write_json({"model": model, "workload": workload, **result, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
