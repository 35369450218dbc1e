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
TTFT less the engine's, for each request. The light phase's median is ``serving_request_ms`` in the fit (a
request's own cost; in the burst the queue adds to both sides). Each phase is replayed once the one before has
finished.
"""

from __future__ import annotations

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


def probe_traces(phases: tuple[dict[str, Any], ...] = PROBE_PHASES) -> list[list[TraceRequest]]:
    """The probe's phases as traces of their own: each is replayed once the one before has finished, so the light
    phase is light."""
    return [synthetic_trace(p["num"], p["rate"], p["input_len"], p["output_len"], p["burstiness"], p["seed"])
            for p in phases]


def warmup_phase(phases: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    """Served before the probe, its steps unused: a fresh server's steps run slower for its first minute or so
    (bench/simulator_validation.py: whichever probe phase came first priced the trace's steps 9% dear; one-row
    decode steps 18.8 ms early and 17.0 later), so the probe's steps come from a warm one. The burst's shape, two
    thirds of its requests, a seed of its own."""
    burst = phases[burst_phase(phases)]
    return {**burst, "num": max(1, burst["num"] * 2 // 3), "seed": burst["seed"] + 1000}


def write_probe(folder: Path, phases: tuple[dict[str, Any], ...]) -> tuple[list[list[TraceRequest]], list[Path]]:
    """The warm-up's and the probe's phase traces, and the files they are written to in ``folder``."""
    traces = probe_traces((warmup_phase(phases), *phases))
    return traces, [write_trace(folder / f"calibration_probe_{i}.jsonl", t) for i, t in enumerate(traces)]


def split_steps(steps: Sequence[Any], began: Sequence[float]) -> list[list[Any]]:
    """Logged steps in windows: the i-th holds those planned from ``began[i]`` until ``began[i + 1]``."""
    bounds = [*began[1:], float("inf")]
    return [[step for step in steps if start <= step.planned_at < end] for start, end in zip(began, bounds, strict=True)]


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


def calibrated(fit: Any, phases: tuple[dict[str, Any], ...], runs: Sequence[tuple[Sequence[TraceRequest],
               dict[str, Any], Sequence[Any]]], overrides: dict[str, Any], traces: Sequence[Path],
               step_log: Path) -> Any:
    """``fit`` with its ``serving_worker`` fitted on the probe's logged steps and its ``serving_request_ms``
    measured on the probe's first tokens (the light phase's median). ``runs``: per phase, its requests, its
    load-generator summary and its logged steps."""
    from ksana.simulator.fit import fit_logged_steps

    by_phase = []
    for requests, measured, steps in runs:
        costs = request_costs_ms(measured, requests, steps)
        by_phase.append({"median_ms": median_cost(costs), "num_requests": sum(c is not None for c in costs),
                         "output_throughput": measured["output_throughput"]})
    request_ms = by_phase[light_phase(phases)]["median_ms"]
    if request_ms is None:
        request_ms = next((p["median_ms"] for p in by_phase if p["median_ms"] is not None), 0.0)
    steps = [step for _, _, phase_steps in runs for step in phase_steps]
    calibration = {"probe": {"phases": list(phases), "traces": [str(t) for t in traces], "step_log": str(step_log),
                             "num_steps": len(steps)},
                   "settings": {k: v for k, v in overrides.items() if v is not None},
                   "phases": by_phase}
    return attrs.evolve(fit, serving_worker=fit_logged_steps(steps), serving_request_ms=max(0.0, request_ms),
                        calibration=calibration)


def calibrate(model: str, profile: str | Path, config_path: str | None, overrides: dict[str, Any],
              folder: Path, seed: int = 0,
              phases: tuple[dict[str, Any], ...] = PROBE_PHASES) -> tuple[Any, list[dict[str, Any]]]:
    """The fit calibrated on a probe served on its own (``calibrated``), and the probe phases' reports.
    ``phases``: the probe's (``PROBE_PHASES``)."""
    from ksana.scheduler.step_log import read_step_log
    from ksana.simulator.simulate import prepare
    from ksana.simulator.validate import measure_in_turn, server_flags

    folder.mkdir(parents=True, exist_ok=True)
    requests, traces = write_probe(folder, phases)
    step_log = folder / "calibration_steps.jsonl"
    setup = prepare(model, config_path, overrides, profile)  # the fit must match the model before a server starts
    measured, _num_blocks, began = measure_in_turn(model, server_flags(overrides, config_path), traces, seed,
                                                   step_log)
    runs = list(zip(requests, measured, split_steps(read_step_log(step_log), began), strict=True))[1:]  # warm-up
    return calibrated(setup.fit, phases, runs, overrides, traces[1:], step_log), measured[1:]
