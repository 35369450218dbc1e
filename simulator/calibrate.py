"""``ksana simulate calibrate``: how much longer a step takes when serving than perf mode measured it.

Perf mode times each step alone, with nothing else on the cores. A server also runs HTTP and every stream's events
after each step, and its load generator shares the machine: on a small CPU that work takes the forward's cores for
a while every step, a little per step and more per row (each row's token is an event, an SSE chunk and a parse in
the client); and each request spends time in HTTP handling and the client before the engine sees it. The
calibration serves the model, replays a probe trace of its own (not the trace to be predicted: a light phase, where
steps hold a row or two, then a burst, where they hold dozens, so that per-step and per-row costs are told apart),
simulates the same probe over a grid of per-step, per-row and per-request costs, and keeps the triple whose
requests' latencies match best: the median over a phase's requests of |log(simulated / measured)| of E2EL, TTFT
and TPOT, averaged over the two phases (so the burst's many requests do not outvote the light phase). They are
saved in the fit as ``serving_step_ms``, ``serving_row_ms`` and ``serving_request_ms``.
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
STEP_MS = tuple(0.5 * i for i in range(13))  # 0 .. 6 ms
ROW_MS = tuple(0.05 * i for i in range(9))  # 0 .. 0.4 ms
REQUEST_MS = tuple(10.0 * i for i in range(4))  # 0 .. 30 ms


def probe_trace() -> list[TraceRequest]:
    requests: list[TraceRequest] = []
    start = 0.0
    for p in PROBE_PHASES:
        phase = synthetic_trace(p["num"], p["rate"], p["input_len"], p["output_len"], p["burstiness"], p["seed"])
        requests += [attrs.evolve(r, arrival_time_s=round(start + r.arrival_time_s, 6)) for r in phase]
        start = requests[-1].arrival_time_s + PROBE_GAP_S
    return requests


def probe_phases() -> list[range]:
    """The probe's requests by phase, as index ranges."""
    bounds = list(itertools.accumulate(p["num"] for p in PROBE_PHASES))
    return [range(start, end) for start, end in zip([0, *bounds[:-1]], bounds, strict=True)]


def mismatch(measured: dict[str, Any], simulated: dict[str, Any], phases: list[range] | None = None) -> float:
    """The median over requests and over E2EL, TTFT and TPOT of |log(simulated / measured)|; with ``phases``, the
    mean over the phases of each one's median."""
    pairs = list(zip(measured["requests"], simulated["requests"], strict=True))
    medians = []
    for phase in phases or [range(len(pairs))]:
        logs = []
        for m, s in (pairs[i] for i in phase):
            if not (m["success"] and s["success"]):
                continue
            for key in ("e2el", "ttft", "tpot"):
                if m[key] and s[key]:
                    logs.append(abs(math.log(s[key] / m[key])))
        medians.append(statistics.median(logs) if logs else math.inf)
    return statistics.fmean(medians)


def calibrate(model: str, profile: str | Path, config_path: str | None, overrides: dict[str, Any],
              folder: Path, seed: int = 0) -> tuple[Any, dict[str, Any]]:
    """The fit with its ``serving_step_ms``, ``serving_row_ms`` and ``serving_request_ms`` set from a probe
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
    grid = list(itertools.product(STEP_MS, ROW_MS, REQUEST_MS))
    scores = {}
    for step_ms, row_ms, request_ms in tqdm(grid, desc="calibrating", unit="sim", leave=False):
        fit = attrs.evolve(setup.fit, serving_step_ms=step_ms, serving_row_ms=row_ms, serving_request_ms=request_ms)
        result = run_simulation(attrs.evolve(setup, fit=fit), requests, seed=seed, progress=False,
                                source=str(trace))
        simulated = build_report(result.timelines, model=model, request_rate=math.inf, burstiness=1.0,
                                 dataset=str(trace), seed=seed, goodput=None)
        scores[(step_ms, row_ms, request_ms)] = mismatch(measured, simulated, probe_phases())
    best_step, best_row, best_request = min(scores, key=scores.get)
    calibration = {"probe": {"phases": list(PROBE_PHASES), "gap_s": PROBE_GAP_S, "trace": str(trace)},
                   "settings": {k: v for k, v in overrides.items() if v is not None},
                   "mismatch_by_step_row_request_ms": {f"{step:.1f},{row:.2f},{request:.0f}": score
                                                       for (step, row, request), score in scores.items()},
                   "measured_output_throughput": measured["output_throughput"]}
    fit = attrs.evolve(setup.fit, serving_step_ms=best_step, serving_row_ms=best_row,
                       serving_request_ms=best_request, calibration=calibration)
    return fit, measured
