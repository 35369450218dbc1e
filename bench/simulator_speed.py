"""How fast the simulator runs: 10,000 requests of a ``smollm2``-sized profile under a load that keeps the scheduler
busy (arrivals faster than the engine serves them, so every step is full), timed on the wall clock.

    python bench/simulator_speed.py                    # the shipped smollm2 fit, 10,000 requests
    python bench/simulator_speed.py --quick            # 1,000 requests

Target: 10,000 requests in at most 30 s on 2 cores (Vidur 0.0.26 takes about 21.6 s for 2,000 on such a machine).
Writes ``bench/results/simulator_speed_<machine kind>.json``.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from ksana.bench.results import machine_info, write_json  # noqa: E402
from ksana.bench.trace import synthetic_trace  # noqa: E402
from ksana.simulator.simulate import prepare, run_simulation  # noqa: E402

RESULTS = Path(__file__).parent / "results"
PROFILE = Path(__file__).resolve().parents[1] / "notebooks" / "data" / "smollm2_latency_fit.json"
TARGET_S = 30.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default=str(PROFILE), help="a latency fit of smollm2 (default: the shipped one)")
    parser.add_argument("--num-requests", type=int, help="default 10,000 (1,000 with --quick)")
    parser.add_argument("--rate", type=float, default=4.0, help="requests/s (default 4: beyond what smollm2 serves)")
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", help="result JSON (default bench/results/simulator_speed_<machine>.json)")
    args = parser.parse_args(argv)
    num = args.num_requests or (1_000 if args.quick else 10_000)
    setup = prepare("smollm2", None, {"max_batch_size": args.max_batch_size}, args.profile)
    trace = synthetic_trace(num, args.rate, (32, 256), (16, 128), seed=0)
    started = time.perf_counter()
    result = run_simulation(setup, trace, progress=True)
    wall = time.perf_counter() - started
    virtual = max(t.finished_s for t in result.timelines)
    mean_rows = sum(s.num_rows for s in result.steps) / len(result.steps)
    print(f"{num} requests, {len(result.steps)} steps (mean {mean_rows:.1f} rows), {virtual:.0f} s simulated "
          f"in {wall:.1f} s of wall time: {num / wall:.0f} requests/s, {len(result.steps) / wall:.0f} steps/s "
          f"(target: 10,000 requests in <= {TARGET_S:.0f} s)")
    kind = "quick" if args.quick else machine_info()["kind"]
    write_json({"num_requests": num, "rate": args.rate, "max_batch_size": args.max_batch_size,
                "num_steps": len(result.steps), "mean_rows_per_step": mean_rows, "simulated_s": virtual,
                "wall_s": wall, "target_s_for_10000": TARGET_S, "profile": args.profile,
                "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
               args.out or RESULTS / f"simulator_speed_{kind}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
