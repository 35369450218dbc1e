"""``ksana simulate calibrate``: what a step and a request cost when serving, which perf mode cannot see.

Perf mode times each step alone, with nothing else on the cores. A server also runs HTTP and every stream's events
after each step, and its load generator shares the machine: on a small CPU that work takes the forward's cores for
a while every step, more with more rows (each row's token is an event, an SSE chunk and a parse in the client);
and a steady run of steps keeps the forward's threads and caches warm where perf mode's isolated rounds do not. So
the step costs are measured where they happen: the calibration serves the model with ``--step-log``, replays a
probe trace of its own (not the trace to be predicted: a burst, where steps hold dozens of rows beside prefills,
then a light phase, where they hold a row or two), and fits the worker's time per step on the logged steps, the same features
and non-negative least squares as the perf fit (``serving_worker_ms`` in the fit, with its held-out error).

Each request also spends time outside the engine, on both sides of it: from its arrival until the scheduler has
it (HTTP, parsing; ``serving_admission_ms``), and from the result of the step that computed a token until the
client reads it (``serving_delivery_ms``). A step's tokens become events, SSE chunks and parses in the client, one
per stream, on the forward's cores, in no fixed order: a step with 60 rows hands its tokens out over tens of
milliseconds, each stream's at its own point of that window (``smollm2`` at saturation on 2 cores: 13-64 ms, p10
to p90, for steps of 48-64 rows; 0-11 ms for steps of one to four), so the gaps a client sees between tokens
spread around the gaps between steps. The step log says when the scheduler received each request, which steps
computed its tokens and when each returned, and the load generator when each request was due and when it read
each token (on the same clock), so both sides are measured, not searched for: the admission is the probe's
median, the delivery's mean a line in the step's rows fitted on every probe token (non-negative least squares).
Which side of the engine the time falls on matters at saturation: a request that reaches the scheduler as a step
is planned rides in it, one that comes a little later waits a whole step. Each phase is replayed once the one
before has finished.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from ksana.bench.trace import TraceRequest, synthetic_trace, write_trace
from ksana.simulator.fit import DELIVERY_FEATURES, fit_logged_steps
from ksana.simulator.latency_model import LinearModel, nnls_absolute
from ksana.simulator.latency_model import fit as fit_linear

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


def probe_phases_for(requests: Sequence[TraceRequest], max_batch_size: int | None = None,
                     phases: tuple[dict[str, Any], ...] = PROBE_PHASES) -> tuple[dict[str, Any], ...]:
    """``phases`` with the burst widened to cover ``requests`` (a trace to be predicted): its prompt and output
    lengths to the trace's, and its requests to as many rows as the trace can run at once (its requests, at most
    ``max_batch_size``). The served step costs are a linear fit, which prices a context or a batch larger than the
    probe's by extrapolation; the probe's own requests stay its own."""
    index = burst_phase(phases)
    burst = phases[index]
    prompts, outputs = [r.prompt_len for r in requests], [r.output_len for r in requests]
    (in_lo, in_hi), (out_lo, out_hi) = burst["input_len"], burst["output_len"]
    rows = min(len(requests), max_batch_size or len(requests))
    widened = {**burst, "num": max(burst["num"], rows), "input_len": (min(in_lo, *prompts), max(in_hi, *prompts)),
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


@attrs.frozen
class RequestDelay:
    """A request's time outside the engine: ``admission_ms`` from when it was due until the scheduler had it, and
    per token, ``(rows, delivery_ms)``: the rows of the step that computed it (the streams that step handed a
    token to) and how long after that step's result its client read it."""

    admission_ms: float
    deliveries: tuple[tuple[int, float], ...]


def request_delays(measured: dict[str, Any], requests: Sequence[TraceRequest],
                   steps: Sequence[Any]) -> list[RequestDelay | None]:
    """Per request, its ``RequestDelay``; None where its first step did not start the prompt afresh (a prefix-cache
    hit) or it failed. The step log's arrivals are the trace's requests in arrival order (checked by prompt
    length), and its request ids follow each through the steps that compute its tokens (those where its context
    has reached the prompt's end); the load generator's ``start_monotonic_s`` puts its due times and its tokens'
    on the step log's clock."""
    start = measured["start_monotonic_s"]
    arrivals = sorted((at, k, index) for k, step in enumerate(steps) for index, at in step.arrivals)
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_time_s)
    delays: list[RequestDelay | None] = [None] * len(requests)
    for i, (arrived_at, k, index) in zip(order, arrivals, strict=False):
        result, prompt_len = measured["requests"][i], requests[i].prompt_len
        new_tokens, context = steps[k].rows[index]
        if not (result["success"] and new_tokens == context <= prompt_len):
            continue
        due = start + requests[i].arrival_time_s
        read_at = list(itertools.accumulate(result["itl"], initial=due + result["ttft"]))
        computed = (step for step in steps[k:] if computes_token(step, steps[k].request_ids[index], prompt_len))
        delays[i] = RequestDelay((arrived_at - due) * 1000, tuple(
            (len(step.rows), (read - step.result_at) * 1000) for read, step in zip(read_at, computed, strict=False)))
    return delays


def computes_token(step: Any, request_id: str, prompt_len: int) -> bool:
    """Whether ``step`` computes one of the request's tokens: its row's context has reached the prompt's end."""
    return any(rid == request_id and context >= prompt_len
               for rid, (_, context) in zip(step.request_ids, step.rows, strict=True))


def median_admission_ms(delays: Sequence[RequestDelay | None]) -> float | None:
    known = [d.admission_ms for d in delays if d is not None]
    return max(0.0, statistics.median(known)) if known else None


def fit_delivery(delays: Sequence[RequestDelay | None]) -> LinearModel | None:
    """A token's mean delivery in ms as ``const + per_row * rows`` of its step, fitted on every token (non-negative
    least squares)."""
    tokens = [token for d in delays if d is not None for token in d.deliveries]
    if not tokens:
        return None
    return fit_linear(DELIVERY_FEATURES, [(1.0, float(rows)) for rows, _ in tokens],
                      [max(0.0, ms) for _, ms in tokens], fitter=nnls_absolute)


def calibrated(fit: Any, phases: tuple[dict[str, Any], ...], runs: Sequence[tuple[Sequence[TraceRequest],
               dict[str, Any], Sequence[Any]]], overrides: dict[str, Any], traces: Sequence[Path],
               step_log: Path) -> Any:
    """``fit`` with its ``serving_worker`` fitted on the probe's logged steps, and its admission and delivery
    measured on the probe's requests (``request_delays``). ``runs``: per phase, its requests, its load-generator
    summary (with ``start_monotonic_s``) and its logged steps."""
    by_phase, delays = [], []
    for requests, measured, steps in runs:
        phase = request_delays(measured, requests, steps)
        known = [d for d in phase if d is not None]
        tokens = [token for d in known for token in d.deliveries]
        by_phase.append({"num_requests": len(known), "output_throughput": measured["output_throughput"],
                         "admission_ms": median_admission_ms(known),
                         "delivery_ms": statistics.median(ms for _, ms in tokens) if tokens else None,
                         "rows": statistics.median(rows for rows, _ in tokens) if tokens else None})
        delays += known
    steps = [step for _, _, phase_steps in runs for step in phase_steps]
    calibration = {"probe": {"phases": list(phases), "traces": [str(t) for t in traces], "step_log": str(step_log),
                             "num_steps": len(steps)},
                   "settings": {k: v for k, v in overrides.items() if v is not None},
                   "phases": by_phase}
    return attrs.evolve(fit, serving_worker=fit_logged_steps(steps),
                        serving_admission_ms=median_admission_ms(delays) or 0.0,
                        serving_delivery=fit_delivery(delays), calibration=calibration)


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
