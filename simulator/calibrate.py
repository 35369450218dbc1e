"""``ksana simulate calibrate``: how much longer a step takes when serving than perf mode measured it.

Perf mode times each step alone, with nothing else on the cores. A server also runs HTTP and every stream's events
after each step, and its load generator shares the machine: on a small CPU that work takes a share of the forward's
cores, so every step runs slower by a factor (a server's step log under ``bench/simulator_validation.py``'s
saturated trace: 1.09 on the worker's times, prefills and decodes alike), plus a little per row (each row's token
is an event, an SSE chunk and a parse in the client); and each request spends time in HTTP handling and the client
before the engine sees it. The calibration serves the model, replays a probe trace of its own (not the trace to be
predicted: a light phase, where steps hold a row or two, then a burst, where they hold dozens and long prefills,
so the factor and the per-row cost are told apart), simulates the same probe over a grid of slowdowns, per-row and
per-request costs, and keeps the triple whose requests' latencies match best (the median over requests of
|log(simulated / measured)| of E2EL, TTFT and TPOT). They are saved in the fit as ``serving_slowdown``,
``serving_row_ms`` and ``serving_request_ms``.
"""

from __future__ import annotations

import itertools
import math
import statistics
from pathlib import Path
from typing import Any

import attrs
from tqdm.auto import tqdm

from ksana.bench.trace import TraceRequest, synthetic_trace, write_trace

# Under a minute: a light phase (one or two rows a step), then a burst that fills steps with dozens of rows.
PROBE_PHASES = (
    {"num": 10, "rate": 0.5, "input_len": (32, 256), "output_len": (32, 128), "burstiness": 1.0, "seed": 7919},
    {"num": 24, "rate": 8.0, "input_len": (64, 512), "output_len": (64, 192), "burstiness": 1.0, "seed": 7920},
)
PROBE_GAP_S = 4.0  # between the light phase's last arrival and the burst's first
SLOWDOWN = tuple(1.0 + 0.025 * i for i in range(9))  # 1.0 .. 1.2
ROW_MS = tuple(0.1 * i for i in range(5))  # 0 .. 0.4 ms
REQUEST_MS = tuple(10.0 * i for i in range(4))  # 0 .. 30 ms


def probe_trace() -> list[TraceRequest]:
    requests: list[TraceRequest] = []
    start = 0.0
    for p in PROBE_PHASES:
        phase = synthetic_trace(p["num"], p["rate"], p["input_len"], p["output_len"], p["burstiness"], p["seed"])
        requests += [attrs.evolve(r, arrival_time_s=round(start + r.arrival_time_s, 6)) for r in phase]
        start = requests[-1].arrival_time_s + PROBE_GAP_S
    return requests


def mismatch(measured: dict[str, Any], simulated: dict[str, Any]) -> float:
    """The median over requests and over E2EL, TTFT and TPOT of |log(simulated / measured)|."""
    logs = []
    for m, s in zip(measured["requests"], simulated["requests"], strict=True):
        if not (m["success"] and s["success"]):
            continue
        for key in ("e2el", "ttft", "tpot"):
            if m[key] and s[key]:
                logs.append(abs(math.log(s[key] / m[key])))
    return statistics.median(logs) if logs else math.inf


def calibrate(model: str, profile: str | Path, config_path: str | None, overrides: dict[str, Any],
              folder: Path, seed: int = 0) -> tuple[Any, dict[str, Any]]:
    """The fit with its ``serving_slowdown``, ``serving_row_ms`` and ``serving_request_ms`` set from a probe
    against a real server; and the probe's report."""
    from ksana.simulator.report import build_report
    from ksana.simulator.simulate import prepare, run_simulation
    from ksana.simulator.validate import measure, server_flags

    folder.mkdir(parents=True, exist_ok=True)
    trace = write_trace(folder / "calibration_probe.jsonl", probe_trace())
    requests = probe_trace()
    prepare(model, config_path, overrides, profile)  # the fit must match the model before a server starts
    measured, num_blocks = measure(model, server_flags(overrides, config_path), trace, seed)
    setup = prepare(model, config_path, overrides, profile, layout_overrides={"num_blocks": num_blocks})
    grid = list(itertools.product(SLOWDOWN, ROW_MS, REQUEST_MS))
    scores = {}
    for slowdown, row_ms, request_ms in tqdm(grid, desc="calibrating", unit="sim", leave=False):
        fit = attrs.evolve(setup.fit, serving_slowdown=slowdown, serving_step_ms=0.0, serving_row_ms=row_ms,
                           serving_request_ms=request_ms)
        result = run_simulation(attrs.evolve(setup, fit=fit), requests, seed=seed, progress=False,
                                source=str(trace))
        simulated = build_report(result.timelines, model=model, request_rate=math.inf, burstiness=1.0,
                                 dataset=str(trace), seed=seed, goodput=None)
        scores[(slowdown, row_ms, request_ms)] = mismatch(measured, simulated)
    best_slowdown, best_row, best_request = min(scores, key=scores.get)
    calibration = {"probe": {"phases": list(PROBE_PHASES), "gap_s": PROBE_GAP_S, "trace": str(trace)},
                   "settings": {k: v for k, v in overrides.items() if v is not None},
                   "mismatch_by_slowdown_row_request_ms": {f"{slowdown:.3f},{row:.2f},{request:.0f}": score
                                                           for (slowdown, row, request), score in scores.items()},
                   "measured_output_throughput": measured["output_throughput"]}
    fit = attrs.evolve(setup.fit, serving_slowdown=best_slowdown, serving_step_ms=0.0, serving_row_ms=best_row,
                       serving_request_ms=best_request, calibration=calibration)
    return fit, measured
