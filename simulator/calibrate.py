"""``ksana simulate calibrate``: what a step and a request cost when serving, which perf mode cannot see.

Perf mode times each step alone, with nothing else on the cores. A server also runs HTTP and every stream's events
after each step, and its load generator shares the machine: on a small CPU that work takes the forward's cores for
a while every step, more with more rows (each row's token is an event, an SSE chunk and a parse in the client);
and a steady run of steps keeps the forward's threads and caches warm where perf mode's isolated rounds do not. So
the step costs are measured where they happen: the calibration serves the model with ``--step-log``, replays a
probe trace of its own (not the trace to be predicted: a burst, where steps hold dozens of rows beside prefills,
then a light phase, where they hold a row or two), and fits the worker's time per step on the logged steps, the same features
and non-negative least squares as the perf fit (``serving_worker_ms`` in the fit, with its held-out error).

Each request also spends time outside the engine: in HTTP handling and the client before the scheduler sees it,
and after its first token until the client reads it. The step log says when the scheduler received each request
and when the step that finished its prompt returned, so that cost is measured, not searched for: the client's
TTFT less the engine's, for each request. The light phase's median is
``serving_request_ms`` in the fit (a request's own cost; in the burst the queue adds to both sides).
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from ksana.bench.trace import TraceRequest, synthetic_trace, write_trace

# About a minute and a half with smollm2 on 2 cores: a burst that fills steps with up to 48 rows beside prefills,
# then a light phase (one or two rows a step). The burst goes first: a fresh server's steps run slower for a minute
# or so (bench/simulator_validation.py's light trace, served after a light-first probe: one-row decode steps 18.8 ms
# early in the probe, 17.0 in the trace).
PROBE_PHASES = (
    {"num": 48, "rate": 8.0, "input_len": (64, 512), "output_len": (64, 192), "burstiness": 1.0, "seed": 7920},
    {"num": 10, "rate": 0.5, "input_len": (32, 256), "output_len": (32, 128), "burstiness": 1.0, "seed": 7919},
)
PROBE_GAP_S = 4.0  # between one phase's last arrival and the next one's first


def burst_phase(phases: Sequence[dict[str, Any]]) -> int:
    """The index of the probe's busiest phase (the highest rate)."""
    return max(range(len(phases)), key=lambda i: phases[i]["rate"])


def light_phase(phases: Sequence[dict[str, Any]]) -> int:
    """The index of the probe's lightest phase, where a request's cost is its own."""
    return min(range(len(phases)), key=lambda i: phases[i]["rate"])


def probe_phases_for(requests: Sequence[TraceRequest],
                     phases: tuple[dict[str, Any], ...] = PROBE_PHASES) -> tuple[dict[str, Any], ...]:
    """``phases`` with the burst's prompt and output lengths widened to cover ``requests``' (a trace to be
    predicted): the served step costs are a linear fit, which prices a context longer than the probe's by
    extrapolation; the probe's own requests stay its own."""
    index = burst_phase(phases)
    burst = phases[index]
    prompts, outputs = [r.prompt_len for r in requests], [r.output_len for r in requests]
    (in_lo, in_hi), (out_lo, out_hi) = burst["input_len"], burst["output_len"]
    widened = {**burst, "input_len": (min(in_lo, *prompts), max(in_hi, *prompts)),
               "output_len": (min(out_lo, *outputs), max(out_hi, *outputs))}
    return (*phases[:index], widened, *phases[index + 1:])


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


def request_costs_ms(measured: dict[str, Any], requests: Sequence[TraceRequest],
                     steps: Sequence[Any]) -> list[float | None]:
    """Per request, its client TTFT less its time in the engine up to its first token: from the scheduler's
    receipt to the result of the step that computed the last of its prompt (the first chunk's step, or a later one
    whose prefill row ends at the prompt's length); None where its first step did not start the prompt afresh
    (a prefix-cache hit) or the request failed. The step log's arrivals are the trace's requests in arrival order,
    checked by prompt length."""
    arrivals = sorted((at, k, step.rows[index]) for k, step in enumerate(steps) for index, at in step.arrivals)
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_time_s)
    costs: list[float | None] = [None] * len(requests)
    for i, (arrived_at, k, (new_tokens, context)) in zip(order, arrivals, strict=False):
        result, prompt_len = measured["requests"][i], requests[i].prompt_len
        if not (result["success"] and new_tokens == context <= prompt_len):
            continue
        done = next((step for step in steps[k:] if any(c == prompt_len and (q > 1 or q == c) for q, c in step.rows)),
                    None)
        if done is not None:
            costs[i] = (result["ttft"] - (done.result_at - arrived_at)) * 1000
    return costs


def median_cost(costs: Sequence[float | None]) -> float | None:
    known = [c for c in costs if c is not None]
    return statistics.median(known) if known else None


def calibrated(fit: Any, requests: Sequence[TraceRequest], measured: dict[str, Any], steps: Sequence[Any],
               phases: tuple[dict[str, Any], ...], overrides: dict[str, Any], trace: Path, step_log: Path) -> Any:
    """``fit`` with its ``serving_worker`` fitted on a probe's logged steps and its ``serving_request_ms`` measured
    on the probe's first tokens (the light phase's median)."""
    from ksana.simulator.fit import fit_logged_steps

    costs = request_costs_ms(measured, requests, steps)
    by_phase = [{"median_ms": median_cost([costs[i] for i in phase]),
                 "num_requests": sum(costs[i] is not None for i in phase)} for phase in probe_phases(phases)]
    request_ms = by_phase[light_phase(phases)]["median_ms"]
    request_ms = request_ms if request_ms is not None else median_cost(costs) or 0.0
    calibration = {"probe": {"phases": list(phases), "gap_s": PROBE_GAP_S, "trace": str(trace),
                             "step_log": str(step_log), "num_steps": len(steps)},
                   "settings": {k: v for k, v in overrides.items() if v is not None},
                   "request_cost_ms_by_phase": by_phase,
                   "measured_output_throughput": measured["output_throughput"]}
    return attrs.evolve(fit, serving_worker=fit_logged_steps(steps), serving_request_ms=max(0.0, request_ms),
                        calibration=calibration)


def calibrate(model: str, profile: str | Path, config_path: str | None, overrides: dict[str, Any],
              folder: Path, seed: int = 0,
              phases: tuple[dict[str, Any], ...] = PROBE_PHASES) -> tuple[Any, dict[str, Any]]:
    """The fit calibrated on a probe served on its own (``calibrated``), and the probe's report. ``phases``: the
    probe's (``PROBE_PHASES``)."""
    from ksana.scheduler.step_log import read_step_log
    from ksana.simulator.simulate import prepare
    from ksana.simulator.validate import measure, server_flags

    folder.mkdir(parents=True, exist_ok=True)
    requests = probe_trace(phases)
    trace = write_trace(folder / "calibration_probe.jsonl", requests)
    step_log = folder / "calibration_steps.jsonl"
    setup = prepare(model, config_path, overrides, profile)  # the fit must match the model before a server starts
    measured, _num_blocks = measure(model, server_flags(overrides, config_path), trace, seed, step_log)
    fit = calibrated(setup.fit, requests, measured, read_step_log(step_log), phases, overrides, trace, step_log)
    return fit, measured
