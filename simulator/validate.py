"""``ksana simulate validate``: the simulator against real serving, on one trace and one configuration.

It profiles the model when no profile is given (a sweep of the steps this configuration can make, replayed by perf
mode on the serving path: operator timing off, so an all-decode step runs fused as it does when serving), serves
the model with ``ksana serve``, replays the trace against it with the load generator, simulates the same trace
with the same settings and the server's own KV pool size, and sets the two side by side.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

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


def measure(model: str, flags: list[str], trace: Path, seed: int) -> tuple[dict[str, Any], int]:
    """Serve the model, replay the trace with the load generator; its summary and the server's KV pool size."""
    import httpx2
    from prometheus_client.parser import text_string_to_metric_families

    from ksana.bench.serve import replay_trace
    from ksana.server.process import ServeProcess

    with ServeProcess("--model", model, *flags, startup_timeout_s=600) as server:
        metrics = httpx2.get(server.url + "/metrics", timeout=30).text
        num_blocks = next(int(s.value) for family in text_string_to_metric_families(metrics)
                          for s in family.samples if s.name == "block_manager_total_block_num")
        return replay_trace(server.url, trace, seed, tuple(PERCENTILES)), num_blocks


def validate(model: str, trace: str | Path, profile: str | Path | None, config_path: str | None,
             overrides: dict[str, Any], out: str | Path, seed: int = 0, progress: bool = True,
             calibrate_first: bool = True) -> dict[str, Any]:
    """Profile (when no profile is given) and calibrate (when the fit has no serving calibration and
    ``calibrate_first``), then measure and simulate ``trace``; writes and returns the comparison."""
    from ksana.simulator.calibrate import calibrate
    from ksana.simulator.fit import load_fit
    from ksana.simulator.report import build_report
    from ksana.simulator.simulate import prepare, run_simulation

    out, trace = Path(out), Path(trace)
    requests = read_trace(trace)
    folder = out.with_suffix("")
    folder.mkdir(parents=True, exist_ok=True)
    if profile is None:
        profile = profile_model(model, config_path, overrides, requests, folder, progress)
    if calibrate_first and load_fit(profile).calibration is None:
        fit, _probe = calibrate(model, profile, config_path, overrides, folder, seed)
        profile = fit.save(folder / "latency_fit_calibrated.json")
    setup = prepare(model, config_path, overrides, profile)  # checks the fit before the server starts
    measured, num_blocks = measure(model, server_flags(overrides, config_path), trace, seed)
    setup = prepare(model, config_path, overrides, profile, layout_overrides={"num_blocks": num_blocks})
    result = run_simulation(setup, requests, seed=seed, progress=progress, source=str(trace))
    simulated = build_report(result.timelines, model=model, request_rate=math.inf, burstiness=1.0,
                             dataset=str(trace), seed=seed, goodput=None, percentiles=PERCENTILES)
    metrics = compare(measured, simulated)
    report = {"metrics": metrics, "trace": str(trace), "profile": str(profile), "model": model,
              "serving_step_ms": setup.fit.serving_step_ms, "serving_row_ms": setup.fit.serving_row_ms,
              "serving_request_ms": setup.fit.serving_request_ms,
              "settings": {k: v for k, v in overrides.items() if v is not None}, "num_blocks": num_blocks,
              "measured": measured, "simulated": simulated}
    out.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    return report
