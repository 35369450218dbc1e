"""``ksana perf``: replay the fixed batches of ``model_perf_config.json`` and write the latency JSON.

Exit codes: 0 when the result is written, 2 for bad input (one line naming the file and the key or batch).
Paths given as flags are relative to the working directory; paths inside the config file to the file's folder.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ksana.config import ConfigError


def _path(value: str | None) -> str | None:
    return None if value is None else str(Path(value).expanduser().resolve())


def add_perf_parser(subparsers) -> None:
    perf = subparsers.add_parser(
        "perf", help="replay fixed batches (model_perf_config.json) and write latency JSON",
        description="ModelPerfBackend: replay each batch of batch_config.json for the warmup and stat rounds of "
                    "model_perf_config.json and write scheduling and operator latencies to its output_file.")
    perf.add_argument("--config", default="model_perf_config.json", help="model_perf_config.json (the default)")
    perf.add_argument("--output-csv", help="also write KsanaLLM's 11-column perf CSV here")
    perf.add_argument("--chrome-trace", help="also write the run's message trace as Chrome trace JSON here")
    perf.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    over = perf.add_argument_group("overrides of model_perf_config.json")
    over.add_argument("--model", dest="model_dir", help="model directory or built-in name (smollm2, demo)")
    over.add_argument("--batch-config", help="batch_config.json path")
    over.add_argument("--runtime-config", help="runtime YAML (setting.* / model_spec.* keys)")
    over.add_argument("--output", dest="output_file", help="result JSON path (output_file)")
    over.add_argument("--warmup-rounds", type=int)
    over.add_argument("--stat-rounds", type=int)
    over.add_argument("--layer-forward-round", type=int, help="run each decoder layer N times per forward")
    over.add_argument("--profile-operators", action=argparse.BooleanOptionalAction, default=None,
                      help="time every operator of the forward (default: the config's, else on)")
    over.add_argument("--seed", type=int, help="seed of the prompt tokens")
    engine = perf.add_argument_group("overrides of the runtime config")
    engine.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    engine.add_argument("--device", choices=["auto", "cpu", "cuda", "npu"])
    engine.add_argument("--num-threads", type=int, help="torch intra-op threads")
    engine.add_argument("--max-batch-size", type=int)
    engine.add_argument("--max-step-tokens", type=int)
    engine.add_argument("--block-token-num", type=int)
    engine.add_argument("--num-device-blocks", type=int, help="KV pool size (default: the largest batch + 10)")
    perf.set_defaults(func=_cmd_perf)


def _cmd_perf(args: argparse.Namespace) -> int:
    from ksana.perf.perf_config import load_model_perf_config
    from ksana.perf.runner import run_model_perf

    model_dir = args.model_dir
    if model_dir is not None and model_dir not in ("smollm2", "demo"):
        model_dir = _path(model_dir)
    perf_overrides = {
        "model_dir": model_dir,
        "batch_config": _path(args.batch_config),
        "runtime_config": _path(args.runtime_config),
        "output_file": _path(args.output_file),
        "warmup_rounds": args.warmup_rounds,
        "stat_rounds": args.stat_rounds,
        "layer_forward_round": args.layer_forward_round,
        "profile_operators": args.profile_operators,
        "seed": args.seed,
    }
    engine_overrides = {
        "dtype": args.dtype,
        "device": args.device,
        "num_threads": args.num_threads,
        "max_batch_size": args.max_batch_size,
        "max_step_tokens": args.max_step_tokens,
        "block_token_num": args.block_token_num,
        "num_device_blocks": args.num_device_blocks,
    }
    try:
        perf = load_model_perf_config(args.config, perf_overrides)
        run = run_model_perf(
            perf,
            engine_overrides,
            output_csv=Path(args.output_csv) if args.output_csv else None,
            chrome_trace=Path(args.chrome_trace) if args.chrome_trace else None,
            progress=not args.no_progress,
        )
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"ksana perf: error: {exc}", file=sys.stderr)
        return 2
    _print_summary(run)
    return 0


def _print_summary(run) -> None:
    """One line per batch on stdout: its shape and the median step, forward and sampling times."""
    print(f"{'batch':<10} {'reqs':>5} {'prefill':>7} {'decode':>6} {'tokens':>6} {'context':>7} "
          f"{'step p50 ms':>11} {'forward p50 ms':>14} {'sample p50 ms':>13}")
    for batch in run.result["batches"]:
        stats = batch["stats"]
        print(f"{batch['name']:<10} {batch['num_requests']:>5} {batch['num_prefill_requests']:>7} "
              f"{batch['num_decode_requests']:>6} {batch['num_tokens']:>6} {batch['total_sequence_len']:>7} "
              f"{stats['step_ms']['p50']:>11.2f} {stats['forward_ms']['p50']:>14.2f} {stats['sample_ms']['p50']:>13.2f}")
    print(f"result: {run.output_file}")
