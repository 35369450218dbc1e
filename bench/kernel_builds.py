"""Two checkouts' CPU kernels side by side: the same engine workloads through each, in alternating processes.

A kernel change that moves no bits can still move time; this sets a candidate tree (default: this one) against a
baseline tree (a ``git worktree`` of the older revision, with its own ``make install``), each run by its own venv's
Python, so the two builds never share a process (two libraries of ``torch.ops.ksana`` cannot). The workloads:

- ``offline``: ``bench/throughput.py``'s workload (64 prompts, 32-256 tokens in, 64-512 out, greedy,
  ``ignore_eos``) through ``LLM.generate``; output tokens/s.
- ``decode_b1``: one 128-token prompt decoding 256 tokens: the steady step's median (the fused decode step and
  the lm_head at batch 1, the roofline's case).
- ``decode_b16``: 16 such prompts at once: the steady step's median.

Each round runs every workload in the baseline and the candidate, the order flipping every round, so the machine's
drift weighs on both; the figure is the median over rounds of candidate / baseline. The CPU's model line goes with
it, as with every figure here.

    git worktree add ../ksana-base <rev> && make -C ../ksana-base install
    python bench/kernel_builds.py --baseline ../ksana-base             # float32, 3 rounds
    python bench/kernel_builds.py --baseline ../ksana-base --dtype bfloat16 --rounds 5
    python bench/kernel_builds.py --baseline . --quick                  # the demo model: checks the script

Writes ``bench/results/kernel_builds_<machine kind>.json`` (``kernel_builds_quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from ksana.bench.results import default_out, write_json

REPO = Path(__file__).resolve().parents[1]

WORKLOADS = ("offline", "decode_b1", "decode_b16")

# Runs inside a tree's own venv: one workload, one JSON line with its figure.
RUNNER = r"""
import json, random, statistics, sys, time
from ksana import LLM, SamplingParams
workload, dtype, model, scale = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
vocab = 49152 if model == "smollm2" else 512
if workload == "offline":
    rng = random.Random(0)
    prompts = [[rng.randrange(256, vocab) for _ in range(rng.randint(32, 256) // scale)] for _ in range(64 // scale)]
    outputs = [rng.randint(64, 512) // scale for _ in range(64 // scale)]
    llm = LLM(model=model, dtype=dtype, max_batch_size=64, max_step_tokens=2048, split_fuse_token_num=512)
    llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outputs]
    started = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    print(json.dumps({"value": sum(outputs) / (time.perf_counter() - started), "unit": "tok/s"}))
else:
    batch = 1 if workload == "decode_b1" else 16
    rng = random.Random(1)
    prompts = [[rng.randrange(256, vocab) for _ in range(128 // scale)] for _ in range(batch)]
    llm = LLM(model=model, dtype=dtype, max_batch_size=batch)
    runner = llm.engine.runner
    execute, times = runner.execute, []
    def timed(plan):
        started = time.perf_counter()
        result = execute(plan)
        times.append((len(plan.rows), sum(r.num_new_tokens for r in plan.rows), time.perf_counter() - started))
        return result
    runner.execute = timed
    params = SamplingParams(temperature=0.0, max_tokens=256 // scale, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    times.clear()
    llm.generate(prompts, params, use_tqdm=False)
    steady = [t for rows, tokens, t in times if rows == batch and tokens == batch]
    print(json.dumps({"value": statistics.median(steady) * 1e3, "unit": "ms/step"}))
"""


def run_workload(tree: Path, workload: str, dtype: str, quick: bool = False) -> dict[str, Any]:
    python = tree / ".venv" / "bin" / "python"
    model, scale = ("demo", 8) if quick else ("smollm2", 1)
    done = subprocess.run([str(python), "-P", "-c", RUNNER, workload, dtype, model, str(scale)], cwd=tree,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{tree}: {workload} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def git_revision(tree: Path) -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True,
                          check=False).stdout.strip()


def cpu_model() -> str:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    return next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "")


def run_bench(baseline: Path, candidate: Path, dtype: str, rounds: int, workloads: tuple[str, ...],
              quick: bool = False) -> dict:
    trees = {"baseline": baseline, "candidate": candidate}
    runs: dict[str, dict[str, list[float]]] = {w: {"baseline": [], "candidate": []} for w in workloads}
    units: dict[str, str] = {}
    for index in range(rounds):
        order = ("baseline", "candidate") if index % 2 == 0 else ("candidate", "baseline")
        for workload in workloads:
            for name in order:
                result = run_workload(trees[name], workload, dtype, quick)
                runs[workload][name].append(result["value"])
                units[workload] = result["unit"]
            print(f"round {index + 1}/{rounds} {workload}: " + ", ".join(
                f"{name} {runs[workload][name][-1]:.2f} {units[workload]}" for name in trees), flush=True)
    table = {}
    for workload, by_tree in runs.items():
        ratios = [c / b for b, c in zip(by_tree["baseline"], by_tree["candidate"], strict=True)]
        table[workload] = {"unit": units[workload], "baseline_median": statistics.median(by_tree["baseline"]),
                           "candidate_median": statistics.median(by_tree["candidate"]),
                           "candidate_over_baseline": statistics.median(ratios), "rounds": by_tree}
    return {"model": "demo" if quick else "smollm2", "dtype": dtype, "rounds": rounds, "cpu": cpu_model(), "arch": platform.machine(),
            "baseline": {"tree": str(baseline), "revision": git_revision(baseline)},
            "candidate": {"tree": str(candidate), "revision": git_revision(candidate)}, "workloads": table}


def format_report(report: dict) -> str:
    lines = [f"CPU: {report['cpu']}; {report['model']}, {report['dtype']}; baseline {report['baseline']['revision']}, candidate "
             f"{report['candidate']['revision']}; median of {report['rounds']} alternating rounds",
             "| workload | baseline | candidate | candidate / baseline |", "|---|---|---|---|"]
    for name, row in report["workloads"].items():
        lines.append(f"| {name} | {row['baseline_median']:.2f} {row['unit']} | {row['candidate_median']:.2f} "
                     f"{row['unit']} | {row['candidate_over_baseline']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, required=True, help="the older tree (with its own .venv)")
    parser.add_argument("--candidate", type=Path, default=REPO, help="the newer tree (default: this one)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="a comma-separated subset")
    parser.add_argument("--quick", action="store_true", help="the demo model, 8x shorter runs: checks the script")
    parser.add_argument("--out", help="result JSON (default bench/results/kernel_builds_<machine kind>.json)")
    args = parser.parse_args(argv)
    workloads = tuple(args.workloads.split(","))
    unknown = set(workloads) - set(WORKLOADS)
    if unknown:
        parser.error(f"unknown workloads: {', '.join(sorted(unknown))}")
    for tree in (args.baseline, args.candidate):
        if not (tree / ".venv" / "bin" / "python").exists():
            parser.error(f"{tree} has no .venv (run make install there)")
    report = run_bench(args.baseline.resolve(), args.candidate.resolve(), args.dtype, args.rounds, workloads,
                       args.quick)
    print(format_report(report))
    write_json(report, Path(args.out) if args.out else default_out(Path(__file__).parent / "results",
                                                                   "kernel_builds", quick=args.quick))
    return 0


if __name__ == "__main__":
    sys.exit(main())
