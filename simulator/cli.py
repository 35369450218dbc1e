"""``ksana simulate``: predict serving latency with the engine's own scheduler on a virtual clock.

    ksana simulate --profile FIT_OR_PERF.json --trace trace.jsonl --out report.json
    ksana simulate --profile FIT_OR_PERF.json --rate 4 --num-requests 1000 --input-len 32:512 --output-len 16:256
    ksana simulate fit model_perf_result.json [more.json ...] --out fit.json
    ksana simulate sweep --out sweep_batch_config.json [--max-batch-size 64 --split-fuse-token-num 256 ...]
    ksana simulate trace --rate 4 --num-requests 100 --input-len 32:512 --output-len 16:256 --out trace.jsonl
    ksana simulate calibrate --model smollm2 --profile fit.json --out fit_calibrated.json
    ksana simulate validate --model smollm2 --trace trace.jsonl [--profile FIT] --out validation.json

Bad input (a profile of another model or dtype, a malformed trace, an unknown SLO metric) is one line naming the
file, line or key, and exit code 2.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import orjson

from ksana.config import BatchSchedulerSetting
from ksana.config_flags import add_config_flags, config_overrides

SLO_NAMES = ("ttft", "tpot", "e2el")


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    try:
        low_i, high_i = int(low), int(high or low)
    except ValueError:
        low_i = high_i = 0
    if not 1 <= low_i <= high_i:
        raise argparse.ArgumentTypeError(f"expected N or LOW:HIGH with 1 <= LOW <= HIGH, got {text!r}")
    return low_i, high_i


def _slo(text: str) -> tuple[str, float]:
    name, _, value = text.partition(":")
    if name not in SLO_NAMES:
        raise argparse.ArgumentTypeError(f"unknown SLO metric {name!r} in {text!r} (one of {', '.join(SLO_NAMES)})")
    try:
        return name, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {name}:MILLISECONDS, got {text!r}") from None


def _rates(text: str) -> tuple[float, ...]:
    """argparse's ``type`` for ``--spec-acceptance``: comma-separated probabilities."""
    try:
        rates = tuple(float(part) for part in text.split(","))
    except ValueError:
        rates = ()
    if not rates or not all(0.0 <= rate <= 1.0 for rate in rates):
        raise argparse.ArgumentTypeError(f"takes probabilities in [0, 1], comma-separated, not {text!r}")
    return rates


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0 (or inf), got {text!r}")
    return value


def _add_workload_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rate", type=_positive_float, default=math.inf,
                        help="requests per second (default inf: all at once)")
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--input-len", type=_range, default=(32, 256), help="prompt lengths, N or LOW:HIGH")
    parser.add_argument("--output-len", type=_range, default=(16, 128), help="output lengths, N or LOW:HIGH")
    parser.add_argument("--burstiness", type=_positive_float, default=1.0,
                        help="gamma shape of the gaps between arrivals (1: Poisson; below 1: burstier)")
    parser.add_argument("--seed", type=int, default=0)


def add_simulate_parser(subparsers) -> None:
    sim = subparsers.add_parser("simulate", help="predict serving latency on a virtual clock from a perf profile",
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(sim)
    sim.add_argument("--profile", help="a latency fit (ksana simulate fit) or a raw perf result, fitted on the fly")
    sim.add_argument("--trace", help="JSONL trace (arrival_time_s, prompt_len, output_len[, prompt_token_ids])")
    _add_workload_flags(sim)
    sim.add_argument("--goodput", type=_slo, nargs="+", metavar="METRIC:MS", help="SLOs: ttft:500 tpot:50 e2el:2000")
    sim.add_argument("--out", default="simulation.json", help="report JSON (the load generator's schema)")
    sim.add_argument("--chrome-trace", help="also write the run's message trace as Chrome trace JSON here")
    sim.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    sim.add_argument("--spec-acceptance", type=_rates, default=(), metavar="P0,P1,...",
                     help="with speculative decoding on: the acceptance rate of the draft at each position")
    sim.set_defaults(func=_cmd_simulate)
    sub = sim.add_subparsers(dest="simulate_command")

    fit = sub.add_parser("fit", help="fit a latency model from perf results and report its held-out error")
    fit.add_argument("results", nargs="+", help="model_perf_result.json files of one configuration")
    fit.add_argument("--out", default="latency_fit.json")
    fit.set_defaults(func=_cmd_fit)

    sweep = sub.add_parser("sweep", help="write a profiling batch_config.json covering what serving produces")
    sweep.add_argument("--out", default="sweep_batch_config.json")
    sweep.add_argument("--max-batch-size", type=int, default=BatchSchedulerSetting().max_batch_size)
    sweep.add_argument("--max-step-tokens", type=int, default=BatchSchedulerSetting().max_step_tokens)
    sweep.add_argument("--split-fuse-token-num", type=int, default=0)
    sweep.add_argument("--max-context", type=int, default=2048, help="longest sequence to profile")
    sweep.set_defaults(func=_cmd_sweep)

    check = sub.add_parser("validate", help="serve, replay a trace, simulate it, and compare the two")
    add_config_flags(check)
    check.add_argument("--trace", required=True, help="the JSONL trace to replay and simulate")
    check.add_argument("--profile", help="a latency fit or perf result (default: profile the model first)")
    check.add_argument("--seed", type=int, default=0, help="seed of the prompts the trace leaves to chance")
    check.add_argument("--no-calibrate", action="store_true",
                       help="simulate with the fit as it is (default: calibrate an uncalibrated fit first)")
    check.add_argument("--out", default="validation.json")
    check.add_argument("--no-progress", action="store_true")
    check.set_defaults(func=_cmd_validate)

    cal = sub.add_parser("calibrate", help="scale a fit's step times to a real server's, from a probe trace")
    add_config_flags(cal)
    cal.add_argument("--profile", required=True, help="the latency fit (or perf result) to calibrate")
    cal.add_argument("--out", default="latency_fit_calibrated.json")
    cal.set_defaults(func=_cmd_calibrate)

    trace = sub.add_parser("trace", help="write a synthetic JSONL trace (the same for the load generator)")
    _add_workload_flags(trace)
    trace.add_argument("--out", default="trace.jsonl")
    trace.set_defaults(func=_cmd_trace)


def _cmd_fit(args: argparse.Namespace) -> int:
    from ksana.simulator.fit import fit_profile
    from ksana.simulator.profile import load_profile

    result = fit_profile(load_profile(args.results))
    print(format_fit(result.to_json()))
    print(f"wrote {result.save(args.out)}")
    return 0


def format_fit(fit: dict[str, Any]) -> str:
    lines = [f"{'model':<22}{'held-out rel. error: mean':>28}{'p90':>8}{'max':>8}"]
    rows = [("worker (this fit)", fit["worker_ms"]), ("worker (DistServe)", fit["baseline_worker_ms"]),
            ("engine around a step", fit["engine_ms"])]
    rows += [(f"operators: {name}", model) for name, model in fit["groups_ms"].items()]
    for label, model in rows:
        err = model["held_out_rel_error"]
        lines.append(f"{label:<22}{err['mean']:>27.1%} {err['p90']:>7.1%} {err['max']:>7.1%}")
    return "\n".join(lines)


def _cmd_sweep(args: argparse.Namespace) -> int:
    from ksana.simulator.sweep import sweep_batches, write_batch_config

    batches = sweep_batches(args.max_batch_size, args.max_step_tokens, args.split_fuse_token_num, args.max_context)
    print(f"wrote {write_batch_config(args.out, batches)} ({len(batches)} batches)")
    return 0


def describe_serving(worker_ms: dict[str, Any] | None, outside: dict[str, Any]) -> str:
    """A calibration in one line: the served step's constant and per-row cost, its held-out error, and a
    request's time outside the engine (``validate.outside_engine``)."""
    from ksana.simulator.validate import describe_outside_engine

    if worker_ms is None:
        return f"steps priced by perf mode; {describe_outside_engine(outside)}"
    coef = dict(zip(worker_ms["features"], worker_ms["coef"], strict=True))
    held_out = worker_ms["held_out_rel_error"]
    return (f"steps as served: {coef['const']:.1f} ms + {coef['rows']:.2f} ms a row + the rest "
            f"(held-out error mean {held_out['mean']:.1%}, p90 {held_out['p90']:.1%}); "
            f"{describe_outside_engine(outside)}")


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from ksana.simulator.calibrate import calibrate
    from ksana.simulator.validate import outside_engine

    if args.model is None:
        raise ValueError("ksana simulate calibrate needs --model")
    out = Path(args.out)
    fit, measured = calibrate(args.model, args.profile, args.config, config_overrides(args),
                              out.with_suffix(""))
    serving_worker = fit.serving_worker.to_json() if fit.serving_worker is not None else None
    completed = sum(phase["completed"] for phase in measured)
    busiest = max(phase["output_throughput"] for phase in measured)
    outside = outside_engine(fit.serving_admission_ms, fit.serving_delivery)
    print(f"serving: {describe_serving(serving_worker, outside)} (probe: {completed} requests, "
          f"{busiest:.1f} output tok/s at its busiest)")
    print(f"wrote {fit.save(out)}")
    return 0


def _cmd_validate(args: argparse.Namespace) -> int:
    from ksana.simulator.validate import format_diagnosis, format_table, validate

    if args.model is None:
        raise ValueError("ksana simulate validate needs --model")
    report = validate(args.model, args.trace, args.profile, args.config, config_overrides(args), args.out,
                      seed=args.seed, progress=not args.no_progress, calibrate_first=not args.no_calibrate)
    print(f"serving: {describe_serving(report['serving_worker_ms'], report['outside_engine_ms']['fit'])}")
    print(format_table(report["metrics"]))
    print(format_diagnosis(report))
    print(f"wrote {args.out}")
    return 0


def _cmd_trace(args: argparse.Namespace) -> int:
    from ksana.bench.trace import synthetic_trace, write_trace

    requests = synthetic_trace(args.num_requests, args.rate, args.input_len, args.output_len, args.burstiness,
                               args.seed)
    print(f"wrote {write_trace(args.out, requests)} ({len(requests)} requests)")
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    from ksana.bench.trace import read_trace, synthetic_trace
    from ksana.simulator.report import build_report
    from ksana.simulator.simulate import prepare, run_simulation

    if args.profile is None:
        raise ValueError("ksana simulate needs --profile (a latency fit or a perf result)")
    setup = prepare(args.model, args.config, config_overrides(args), args.profile,
                    spec_acceptance=args.spec_acceptance)
    if args.trace:
        requests, dataset = read_trace(args.trace), args.trace
    else:
        requests = synthetic_trace(args.num_requests, args.rate, args.input_len, args.output_len, args.burstiness,
                                   args.seed)
        dataset = "synthetic"
    result = run_simulation(setup, requests, seed=args.seed, progress=not args.no_progress,
                            trace_capacity=1_000_000 if args.chrome_trace else 0, source=args.trace or "workload")
    report = build_report(result.timelines, model=setup.config.model_spec.base_model.model_dir,
                          request_rate=args.rate, burstiness=args.burstiness, dataset=dataset, seed=args.seed,
                          goodput=dict(args.goodput or []))
    report["simulation"] = {"wall_s": result.wall_s, "num_steps": len(result.steps),
                            "num_blocks": setup.layout.num_blocks, "block_size": setup.layout.block_size,
                            "profile": str(args.profile), "fit_identity": setup.fit.identity}
    if result.spec_stats is not None:
        report["simulation"]["speculative_decoding"] = result.spec_stats.to_dict()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    if args.chrome_trace and result.trace is not None:
        result.trace.write_chrome_trace(args.chrome_trace)
    from ksana.bench.serve import print_table

    print_table(report, [50.0, 90.0, 99.0])
    print(f"simulated {len(requests)} requests ({len(result.steps)} steps) in {result.wall_s:.1f} s; wrote {out}",
          file=sys.stderr)
    return 0
