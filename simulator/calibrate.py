"""``ksana simulate calibrate``: how much longer a step takes when serving than perf mode measured it.

Perf mode times each step alone, with nothing else on the cores. A server also runs HTTP and every stream's events
after each step, and its load generator shares the machine: on a small CPU that work takes the forward's cores for
a while every step, whatever the step's size (it shows as a sixth of a lone request's decode step on two cores, and
vanishes in a long prefill's). The calibration serves the model, replays a short probe trace of its own (not the
trace to be predicted), simulates the same probe with several per-step costs added to the worker's time, and keeps
the one whose requests' latencies match best (the median over requests of |log(simulated / measured)| of E2EL,
TTFT and TPOT). It is saved in the fit as ``serving_step_ms``.
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
STEP_MS = tuple(0.25 * i for i in range(41))  # 0 .. 10 ms


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
    """The fit with its ``serving_step_ms`` set from a probe against a real server; and the probe's report."""
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
        scaled = attrs.evolve(setup, fit=attrs.evolve(setup.fit, serving_step_ms=step_ms))
        result = run_simulation(scaled, requests, seed=seed, progress=False, source=str(trace))
        simulated = build_report(result.timelines, model=model, request_rate=PROBE["rate"], burstiness=1.0,
                                 dataset=str(trace), seed=seed, goodput=None)
        scores[step_ms] = mismatch(measured, simulated)
    best = min(scores, key=scores.get)
    calibration = {"probe": {**PROBE, "trace": str(trace)}, "settings": {k: v for k, v in overrides.items()
                                                                          if v is not None},
                   "mismatch_by_step_ms": {f"{step_ms:.2f}": score for step_ms, score in scores.items()},
                   "measured_output_throughput": measured["output_throughput"]}
    return attrs.evolve(setup.fit, serving_step_ms=best, calibration=calibration), measured
