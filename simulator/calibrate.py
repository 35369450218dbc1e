"""``ksana simulate calibrate``: what a step and a request cost when serving, which perf mode cannot see.

Perf mode times each step alone, with nothing else on the cores. A server also runs HTTP and every stream's events
after each step, and its load generator shares the machine: on a small CPU that work takes the forward's cores for
a while every step, more with more rows (each row's token is an event, an SSE chunk and a parse in the client);
and a steady run of steps keeps the forward's threads and caches warm where perf mode's isolated rounds do not. So
the step costs are measured where they happen: the calibration serves the model with ``--step-log``, replays a
probe trace of its own (not the trace to be predicted: a light phase, where steps hold a row or two, then a burst,
where they hold dozens beside prefills), and fits the worker's time per step on the logged steps, the same features
and non-negative least squares as the perf fit (``serving_worker_ms`` in the fit, with its held-out error).

Each request also spends time in HTTP handling and the client before the engine sees it. That one cost is found
by simulating the probe over a range of it and keeping the value whose requests' latencies match best: the median
over a phase's requests of |log(simulated / measured)| of E2EL, TTFT and TPOT, averaged over the two phases (so the
burst's many requests do not outvote the light phase); ``serving_request_ms`` in the fit.
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

# About a minute and a half with smollm2 on 2 cores: a light phase (one or two rows a step), then a burst that
# fills steps with up to 48 rows beside prefills.
PROBE_PHASES = (
    {"num": 10, "rate": 0.5, "input_len": (32, 256), "output_len": (32, 128), "burstiness": 1.0, "seed": 7919},
    {"num": 48, "rate": 8.0, "input_len": (64, 512), "output_len": (64, 192), "burstiness": 1.0, "seed": 7920},
)
PROBE_GAP_S = 4.0  # between the light phase's last arrival and the burst's first
REQUEST_MS = tuple(5.0 * i for i in range(9))  # 0 .. 40 ms


def probe_trace(phases: tuple[dict[str, Any], ...] = PROBE_PHASES) -> list[TraceRequest]:
    requests: list[TraceRequest] = []
    start = 0.0
    for p in phases:
        phase = synthetic_trace(p["num"], p["rate"], p["input_len"], p["output_len"], p["burstiness"], p["seed"])
        requests += [attrs.evolve(r, arrival_time_s=round(start + r.arrival_time_s, 6)) for r in phase]
        start = requests[-1].arrival_time_s + PROBE_GAP_S
    return requests


def probe_phases(phases: tuple[dict[str, Any], ...] = PROBE_PHASES) -> list[range]:
    """The probe's requests by phase, as index ranges."""
    bounds = list(itertools.accumulate(p["num"] for p in phases))
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
              folder: Path, seed: int = 0,
              phases: tuple[dict[str, Any], ...] = PROBE_PHASES) -> tuple[Any, dict[str, Any]]:
    """The fit with its ``serving_worker`` fitted on a probe's step log and its ``serving_request_ms`` matched to
    the probe's latencies; and the probe's report. ``phases``: the probe's (``PROBE_PHASES``)."""
    from ksana.simulator.fit import fit_step_log
    from ksana.simulator.report import build_report
    from ksana.simulator.simulate import prepare, run_simulation
    from ksana.simulator.validate import measure, server_flags

    folder.mkdir(parents=True, exist_ok=True)
    requests = probe_trace(phases)
    trace = write_trace(folder / "calibration_probe.jsonl", requests)
    step_log = folder / "calibration_steps.jsonl"
    prepare(model, config_path, overrides, profile)  # the fit must match the model before a server starts
    measured, num_blocks = measure(model, server_flags(overrides, config_path), trace, seed, step_log)
    serving_worker, steps = fit_step_log(step_log)
    setup = prepare(model, config_path, overrides, profile, layout_overrides={"num_blocks": num_blocks})
    scores = {}
    for request_ms in tqdm(REQUEST_MS, desc="calibrating", unit="sim", leave=False):
        fit = attrs.evolve(setup.fit, serving_worker=serving_worker, serving_request_ms=request_ms)
        result = run_simulation(attrs.evolve(setup, fit=fit), requests, seed=seed, progress=False,
                                source=str(trace))
        simulated = build_report(result.timelines, model=model, request_rate=math.inf, burstiness=1.0,
                                 dataset=str(trace), seed=seed, goodput=None)
        scores[request_ms] = mismatch(measured, simulated, probe_phases(phases))
    best_request = min(scores, key=scores.get)
    calibration = {"probe": {"phases": list(phases), "gap_s": PROBE_GAP_S, "trace": str(trace),
                             "step_log": str(step_log), "num_steps": len(steps)},
                   "settings": {k: v for k, v in overrides.items() if v is not None},
                   "mismatch_by_request_ms": {f"{request:.0f}": score for request, score in scores.items()},
                   "measured_output_throughput": measured["output_throughput"]}
    fit = attrs.evolve(setup.fit, serving_worker=serving_worker, serving_request_ms=best_request,
                       calibration=calibration)
    return fit, measured
