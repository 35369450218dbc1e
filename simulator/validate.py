"""``ksana simulate validate``: the simulator against real serving, on one trace and one configuration.

It profiles the model when no profile is given (a sweep of the steps this configuration can make, replayed by perf
mode on the serving path: operator timing off, so an all-decode step runs fused as it does when serving), serves
the model with ``ksana serve --step-log``, replays the trace against it with the load generator, simulates the
same trace with the same settings and the server's own KV pool size, and sets the two side by side.

The server's step log splits what is left into its two causes. ``step_cost_ratio`` is how long the served steps
took against what the fit predicts for them (on a shared machine the same step's cost moves from one minute to
the next), and ``outside_engine_ms`` is this run's own admission and delivery (a request's time outside the
engine, ``ksana.simulator.calibrate``) against the fit's; ``metrics_with_served_steps`` simulates the trace again
with the step costs fitted on this run's own log and its own admission and delivery, and
``metrics_with_served_speed`` with the fit's prices scaled by how fast this run's steps ran at each moment
(``ksana.simulator.served_speed``) and its own admission and delivery: the errors left there are the scheduler's and
the step model's, not the machine's.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import orjson

from ksana.bench.trace import TraceRequest, read_trace

# The table's rows: (name in validation.json, key in the load generator's summary).
METRICS: tuple[tuple[str, str], ...] = (
    ("ttft_p50_ms", "median_ttft_ms"),
    ("ttft_p90_ms", "p90_ttft_ms"),
    ("tpot_p50_ms", "median_tpot_ms"),
    ("tpot_p90_ms", "p90_tpot_ms"),
    ("itl_p50_ms", "median_itl_ms"),
    ("e2el_p50_ms", "median_e2el_ms"),
    ("output_throughput_tok_s", "output_throughput"),
)
PERCENTILES = [50.0, 90.0, 99.0]


def compare(measured: dict[str, Any], simulated: dict[str, Any]) -> dict[str, dict[str, float]]:
    rows = {}
    for name, key in METRICS:
        m, s = float(measured[key]), float(simulated[key])
        rows[name] = {"measured": m, "simulated": s, "rel_error": abs(s - m) / m if m else math.inf}
    return rows


def format_table(metrics: dict[str, dict[str, float]]) -> str:
    lines = [f"{'metric':<26}{'measured':>12}{'simulated':>12}{'rel_error':>11}"]
    lines += [f"{name:<26}{row['measured']:>12.2f}{row['simulated']:>12.2f}{row['rel_error']:>10.1%}"
              for name, row in metrics.items()]
    return "\n".join(lines)


def outside_engine(admission_ms: float, delivery: Any) -> dict[str, Any]:
    """A request's admission and a token's delivery (``LatencyFit``'s) as a report records them."""
    const, per_row = delivery.coef if delivery is not None else (0.0, 0.0)
    return {"admission": admission_ms, "delivery": {"const": const, "per_row": per_row}}


def describe_outside_engine(delays: dict[str, Any]) -> str:
    delivery = delays["delivery"]
    return (f"admission {delays['admission']:.1f} ms, delivery {delivery['const']:.1f} + "
            f"{delivery['per_row']:.2f} ms a row")


def format_diagnosis(report: dict[str, Any]) -> str:
    """The step-cost ratio, the time outside the engine and the table simulated with the run's own costs."""
    ratio, outside = report["step_cost_ratio"], report["outside_engine_ms"]
    served = "n/a" if outside["served"] is None else describe_outside_engine(outside["served"])
    return (f"served steps took {ratio['all']:.2f}x the fit's prices (median of {ratio['num_steps']}; decode-only "
            f"{ratio['decode']:.2f}x, with a prefill {ratio['prefill']:.2f}x); outside the engine: {served} (the "
            f"fit: {describe_outside_engine(outside['fit'])}); simulated with this run's own costs:\n"
            + format_table(report["metrics_with_served_steps"])
            + "\nsimulated with the fit's prices at this run's speed over time:\n"
            + format_table(report["metrics_with_served_speed"]))


def server_flags(overrides: dict[str, Any], config_path: str | None) -> list[str]:
    """The same settings as ``ksana serve`` flags."""
    flags = ["--config", config_path] if config_path else []
    for key, value in overrides.items():
        if value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if key == "enable_auto_prefix_cache":
            flags += ["--enable-prefix-caching"] if value else []
        elif key == "async_scheduling":
            flags.append("--async-scheduling" if value else "--no-async-scheduling")
        else:
            flags += [flag, str(value)]
    return flags


def profile_model(model: str, config_path: str | None, overrides: dict[str, Any], requests: list[TraceRequest],
                  folder: Path, progress: bool = True) -> Path:
    """Sweep, perf run and fit for this configuration; returns the saved fit."""
    from ksana.config import load_config
    from ksana.perf.perf_config import ModelPerfConfig
    from ksana.perf.runner import run_model_perf
    from ksana.simulator.fit import fit_profile
    from ksana.simulator.profile import load_profile
    from ksana.simulator.sweep import sweep_batches, write_batch_config

    sched = load_config(config_path, model_dir=model, **overrides).setting.batch_scheduler
    longest = max(r.prompt_len + r.output_len for r in requests)
    max_context = max(64, min(4096, 1 << (longest - 1).bit_length()))
    batches = sweep_batches(sched.max_batch_size, sched.max_step_tokens, sched.split_fuse_token_num, max_context)
    batch_config = write_batch_config(folder / "sweep_batch_config.json", batches)
    perf = ModelPerfConfig(path=folder / "model_perf_config.json", model_dir=model, batch_config=batch_config,
                           runtime_config=Path(config_path) if config_path else None, warmup_rounds=1,
                           stat_rounds=3, output_file=folder / "sweep_perf_result.json", profile_operators=False,
                           layer_forward_round=1, seed=0)
    perf_overrides = {key: value for key, value in overrides.items()
                      if key in ("dtype", "max_batch_size", "max_step_tokens", "block_token_num")}
    run_model_perf(perf, perf_overrides, progress=progress)
    fit = fit_profile(load_profile([perf.output_file]))
    return fit.save(folder / "latency_fit.json")


def step_cost_ratio(fit: Any, steps: list[Any]) -> dict[str, float | int]:
    """The served steps' times over the fit's prices for them: the median over all steps, decode-only steps and
    steps with a prefill."""
    from ksana.simulator.features import StepShape

    ratios: dict[str, list[float]] = {"all": [], "decode": [], "prefill": []}
    for step in steps:
        shape = StepShape(step.rows)
        ratio = step.duration_s / max(fit.worker_s(shape), 1e-9)
        ratios["all"].append(ratio)
        ratios["prefill" if shape.num_prefill_rows else "decode"].append(ratio)
    return {**{key: statistics.median(values) if values else math.nan for key, values in ratios.items()},
            "num_steps": len(steps)}


def measure_in_turn(model: str, flags: list[str], traces: Sequence[Path], seed: int,
                    step_log: Path | None = None) -> tuple[list[dict[str, Any]], int, list[float]]:
    """Serve the model once (writing its step log to ``step_log``, if given) and replay ``traces`` one after the
    other with the load generator, each when the one before has finished; their summaries, the server's KV pool
    size, and when each replay began (``time.monotonic()``, the step log's clock)."""
    import time

    import httpx2
    from prometheus_client.parser import text_string_to_metric_families

    from ksana.bench.serve import replay_trace
    from ksana.server.process import ServeProcess

    flags = [*flags, "--step-log", str(step_log)] if step_log is not None else flags
    with ServeProcess("--model", model, *flags, startup_timeout_s=600) as server:
        metrics = httpx2.get(server.url + "/metrics", timeout=30).text
        num_blocks = next(int(s.value) for family in text_string_to_metric_families(metrics)
                          for s in family.samples if s.name == "block_manager_total_block_num")
        summaries, began = [], []
        for trace in traces:
            began.append(time.monotonic())
            summaries.append(replay_trace(server.url, trace, seed, tuple(PERCENTILES)))
        return summaries, num_blocks, began


def measure(model: str, flags: list[str], trace: Path, seed: int,
            step_log: Path | None = None) -> tuple[dict[str, Any], int]:
    """Serve the model and replay one trace: its summary and the server's KV pool size."""
    summaries, num_blocks, _ = measure_in_turn(model, flags, [trace], seed, step_log)
    return summaries[0], num_blocks


def validate(model: str, trace: str | Path, profile: str | Path | None, config_path: str | None,
             overrides: dict[str, Any], out: str | Path, seed: int = 0, progress: bool = True,
             calibrate_first: bool = True,
             probe_phases: tuple[dict[str, Any], ...] | None = None) -> dict[str, Any]:
    """Profile (when no profile is given), measure ``trace`` (after a calibration probe on the same server, when
    the fit has no serving calibration and ``calibrate_first``; ``probe_phases``: the probe's, by default
    ``PROBE_PHASES`` widened to the trace's lengths), and simulate it; writes and returns the comparison."""
    from ksana.scheduler.step_log import read_step_log
    from ksana.simulator.calibrate import (
        calibrated,
        fit_delivery,
        median_admission_ms,
        probe_phases_for,
        request_delays,
        split_steps,
        write_probe,
    )
    from ksana.simulator.fit import fit_logged_steps
    from ksana.simulator.report import build_report
    from ksana.simulator.served_speed import served_speed
    from ksana.simulator.simulate import prepare, run_simulation

    out, trace = Path(out), Path(trace)
    requests = read_trace(trace)
    folder = out.with_suffix("")
    folder.mkdir(parents=True, exist_ok=True)
    if profile is None:
        profile = profile_model(model, config_path, overrides, requests, folder, progress)
    setup = prepare(model, config_path, overrides, profile)  # checks the fit before the server starts
    step_log, flags = folder / "measured_steps.jsonl", server_flags(overrides, config_path)
    if calibrate_first and setup.fit.calibration is None:
        # the probe, then the trace, on one server: the steps that set the prices run in the same process, just
        # before the steps they price (a served step's cost drifts from one server and minute to the next)
        phases = probe_phases or probe_phases_for(requests, setup.config.scheduler.max_batch_size)
        probe_requests, probe = write_probe(folder, phases)
        summaries, num_blocks, began = measure_in_turn(model, flags, [*probe, trace], seed, step_log)
        _warmup, *windows, steps = split_steps(read_step_log(step_log), began)
        *probed, measured = summaries[1:]
        fit = calibrated(setup.fit, phases, list(zip(probe_requests[1:], probed, windows, strict=True)), overrides,
                         probe[1:], step_log)
        profile = fit.save(folder / "latency_fit_calibrated.json")
    else:
        measured, num_blocks = measure(model, flags, trace, seed, step_log)
        steps = read_step_log(step_log)
    setup = prepare(model, config_path, overrides, profile, layout_overrides={"num_blocks": num_blocks})

    def simulate(setup_: Any, speed: Any = None) -> dict[str, Any]:
        result = run_simulation(setup_, requests, seed=seed, progress=progress, source=str(trace), speed=speed)
        return build_report(result.timelines, model=model, request_rate=math.inf, burstiness=1.0,
                            dataset=str(trace), seed=seed, goodput=None, percentiles=PERCENTILES)

    simulated = simulate(setup)
    metrics = compare(measured, simulated)
    served = fit_logged_steps(steps)
    delays = request_delays(measured, requests, steps)
    admission_ms, delivery = median_admission_ms(delays), fit_delivery(delays)  # None: no prompt matched
    own_delays = attrs.evolve(setup.fit, serving_admission_ms=(
        setup.fit.serving_admission_ms if admission_ms is None else admission_ms),
        serving_delivery=setup.fit.serving_delivery if delivery is None else delivery)
    own = attrs.evolve(own_delays, serving_worker=served)
    with_served_steps = simulate(attrs.evolve(setup, fit=own))
    speed = served_speed(setup.fit, steps, measured["start_monotonic_s"])
    with_served_speed = simulate(attrs.evolve(setup, fit=own_delays), speed)
    report = {"metrics": metrics, "trace": str(trace), "profile": str(profile), "model": model,
              "serving_worker_ms": (setup.fit.serving_worker.to_json() if setup.fit.serving_worker is not None
                                    else None),
              "serving_admission_ms": setup.fit.serving_admission_ms,
              "serving_delivery_ms": (setup.fit.serving_delivery.to_json() if setup.fit.serving_delivery is not None
                                      else None),
              "settings": {k: v for k, v in overrides.items() if v is not None}, "num_blocks": num_blocks,
              "step_cost_ratio": step_cost_ratio(setup.fit, steps),
              "outside_engine_ms": {
                  "fit": outside_engine(setup.fit.serving_admission_ms, setup.fit.serving_delivery),
                  "served": None if delivery is None else outside_engine(own.serving_admission_ms, delivery)},
              "metrics_with_served_steps": compare(measured, with_served_steps),
              "metrics_with_served_speed": compare(measured, with_served_speed), "served_speed": speed.to_json(),
              "measured": measured, "simulated": simulated}
    out.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    return report
