"""``ksana simulate calibrate``: how much longer a step takes when serving than perf mode measured it.

Perf mode times each step alone, with nothing else on the cores. A server also runs HTTP and every stream's events
after each step, and its load generator shares the machine: on a small CPU that work takes the forward's cores for
a while every step, whatever the step's size; and each request spends time in HTTP handling and the client before
the engine sees it and after its first token (tens of milliseconds of a small model's TTFT on two cores). The
calibration serves the model, replays a short probe trace of its own (not the trace to be predicted), simulates the
same probe over a grid of per-step and per-request costs, and keeps the pair whose requests' latencies match best
(the median over requests of |log(simulated / measured)| of E2EL, TTFT and TPOT). They are saved in the fit as
``serving_step_ms`` and ``serving_request_ms``.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

import attrs

from ksana.bench.trace import TraceRequest, synthetic_trace, write_trace

# A minute's mix of arrivals, short and long prompts and outputs: neither idle nor saturated.
PROBE = {"num": 32, "rate": 2.0, "input_len": (32, 512), "output_len": (16, 160), "burstiness": 1.0, "seed": 7919}
STEP_MS = tuple(0.5 * i for i in range(17))  # 0 .. 8 ms
REQUEST_MS = tuple(5.0 * i for i in range(13))  # 0 .. 60 ms


def probe_trace() -> list[TraceRequest]:
    p = PROBE
    return synthetic_trace(p["num"], p["rate"], p["input_len"], p["output_len"], p["burstiness"], p["seed"])


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
    """The fit with its ``serving_step_ms`` and ``serving_request_ms`` set from a probe against a real server;
    and the probe's report."""
    from ksana.simulator.report import build_report
    from ksana.simulator.simulate import prepare, run_simulation
    from ksana.simulator.validate import measure, server_flags

    folder.mkdir(parents=True, exist_ok=True)
    trace = write_trace(folder / "calibration_probe.jsonl", probe_trace())
    requests = probe_trace()
    prepare(model, config_path, overrides, profile)  # the fit must match the model before a server starts
    measured, num_blocks = measure(model, server_flags(overrides, config_path), trace, seed)
    setup = prepare(model, config_path, overrides, profile, layout_overrides={"num_blocks": num_blocks})
    scores = {}
    for step_ms in STEP_MS:
        for request_ms in REQUEST_MS:
            fit = attrs.evolve(setup.fit, serving_step_ms=step_ms, serving_request_ms=request_ms)
            result = run_simulation(attrs.evolve(setup, fit=fit), requests, seed=seed, progress=False,
                                    source=str(trace))
            simulated = build_report(result.timelines, model=model, request_rate=PROBE["rate"], burstiness=1.0,
                                     dataset=str(trace), seed=seed, goodput=None)
            scores[(step_ms, request_ms)] = mismatch(measured, simulated)
    best_step, best_request = min(scores, key=scores.get)
    calibration = {"probe": {**PROBE, "trace": str(trace)}, "settings": {k: v for k, v in overrides.items()
                                                                          if v is not None},
                   "mismatch_by_step_and_request_ms": {f"{step:.1f},{request:.0f}": score
                                                       for (step, request), score in scores.items()},
                   "measured_output_throughput": measured["output_throughput"]}
    fit = attrs.evolve(setup.fit, serving_step_ms=best_step, serving_request_ms=best_request,
                       calibration=calibration)
    return fit, measured
