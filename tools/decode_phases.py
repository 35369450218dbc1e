"""Where the fused decode step's time goes: each phase between its barriers, against that phase's own ceiling.

The native CPU kernels run every decoder layer of an all-decode step in one call (``decode_layers`` in
``kernels/cpu/decode_layers.cpp``), its threads meeting at a barrier after each phase. This script builds those kernels
once more with ``-DKSANA_PHASE_CLOCK`` (the same code, with a clock at each barrier: each thread's time up to it and
its wait there), runs ``smollm2`` through ``LLM.generate`` with the engine's fused step and greedy lm_head swapped
for the clocked build's, and prints per steady decode step:

- each phase's time (its threads' mean of work + wait; the wait is what the phase's slowest thread cost the rest),
  what it moved (FLOPs of the projections, bytes of weights; bytes of KV for the attention) and the rate it ran at;
- the phase at its own ceiling, measured in the same run as ``bench/roofline.py`` measures them (the float32
  matmul rate and the read bandwidth): max(FLOPs / matmul rate, bytes / read bandwidth);
- the sum of those per-phase floors, which is what the step costs when no phase overlaps another, against the
  roofline bound of ``bench/roofline.py`` (the step's bytes and FLOPs each at their ceiling, as if they overlapped):
  their ratio is the best step / bound a step whose phases run one after the other can reach.

Why: the roofline target asks for the step within 1.4x of the bound. Batch 16 at context 512 reads 377 MB of KV
in the attention and multiplies 3.4 GFLOP in the projections, and the two run one after the other; this shows how
far each phase is from its own ceiling and how much of the remaining gap is the phases not overlapping.

    python tools/decode_phases.py                 # smollm2, batch 1 and 16 at contexts 128 and 512
    python tools/decode_phases.py --batches 16 --contexts 512 --rounds 5
    python tools/decode_phases.py --quick         # the demo model, small shapes: checks the script
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import torch
from transformers import AutoConfig

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))  # roofline's settings and capture
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _sources, when loaded by the tests
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _sources import build_library  # noqa: E402
from roofline import Settings as RooflineSettings  # noqa: E402
from roofline import (  # noqa: E402
    best_ceilings,
    decode_step_cost,
    matmul_params,
    measure_ceilings,
    roofline_bound,
)

from ksana import LLM, SamplingParams  # noqa: E402
from ksana.bench.results import write_json  # noqa: E402
from ksana.builtin import resolve_model_dir  # noqa: E402
from ksana.kernels.cpu.build import HERE  # noqa: E402
from ksana.kernels.cpu.ops import NativeCPUOps  # noqa: E402
from ksana.models.shape import ModelShape  # noqa: E402

SKIP_STEPS = 2  # each generate call's first decode steps (caches and pools settling)
# The phases in the order of decode_layers' barriers (the Phase enum in decode_layers.cpp).
PHASES = ("norm", "qkv", "rotary+store", "attention", "combine", "pack", "o", "post_norm", "gate_up", "silu",
          "down")
PROJECTIONS = ("qkv", "o", "gate_up", "down")


@attrs.frozen
class Settings:
    model: str = "smollm2"
    batches: tuple[int, ...] = (1, 16)
    contexts: tuple[int, ...] = (128, 512)
    tokens: int = 32
    rounds: int = 3  # generate calls per configuration; the fastest (lowest median fused call) counts
    bandwidth_mib: int = 512
    gemm_n: int = 2048
    ceiling_repeats: int = 7


QUICK = Settings(model="demo", batches=(1, 4), contexts=(16, 48), tokens=8, rounds=2, bandwidth_mib=64, gemm_n=512,
                 ceiling_repeats=3)


@attrs.define
class ClockedSteps:
    """The clocked build's calls of one generate: per fused step its seconds and each thread's phase clocks."""

    batch: int
    threads: int
    fused_s: list[float] = attrs.Factory(list)
    clocks: list[list[list[list[float]]]] = attrs.Factory(list)  # [step][thread][work, wait][phase]
    lm_head_s: list[float] = attrs.Factory(list)
    seq_lens: list[list[int]] = attrs.Factory(list)


def clocked_ops(directory: Path) -> tuple[NativeCPUOps, Any]:
    """The working tree's kernels built with ``-DKSANA_PHASE_CLOCK`` into ``directory`` (made here): the ops and
    the build's operators, whose ``decode_phase_clock`` reads the clock."""
    library = build_library(HERE, directory / "clocked", defines=("KSANA_PHASE_CLOCK",))
    if library.decode_phase_count() != len(PHASES):  # the C enum changed without PHASES
        raise RuntimeError(f"the clocked build has {library.decode_phase_count()} phases, PHASES names {len(PHASES)}")
    return NativeCPUOps(library), library


def read_clock(library: Any, threads: int) -> list[list[list[float]]]:
    raw = torch.empty((threads, 2, len(PHASES)), dtype=torch.float64)
    library.decode_phase_clock(raw)
    return raw.tolist()


def install(llm: LLM, ops: NativeCPUOps, library: Any, state: dict[str, Any]) -> None:
    """The engine's fused step replaced by the clocked build's, and the lm_head after it timed: the fused steps of
    ``state["run"]``'s batch size go into it."""
    model = llm.engine.model

    def decode_layers(layers, hidden, cos, sin, meta):
        read_clock(library, torch.get_num_threads())  # clears what a call of another size left
        started = time.perf_counter()
        out = ops.decode_layers(layers, hidden, cos, sin, meta)
        elapsed = time.perf_counter() - started
        run = state["run"]
        if run is not None and hidden.shape[0] == run.batch and out is not None:
            run.fused_s.append(elapsed)
            run.clocks.append(read_clock(library, run.threads))
            run.seq_lens.append(meta.seq_lens.tolist())
            state["fused_step"] = True  # the lm_head call that follows is this step's
        return out

    def timed_lm_head(fn):
        def call(hidden, *args):
            started = time.perf_counter()
            out = fn(hidden, *args)
            if out is not None and state.pop("fused_step", False):  # None: the fused greedy did not apply
                state["run"].lm_head_s.append(time.perf_counter() - started)
            return out

        return call

    # the lm_head: fused with the greedy pick from FUSED_GREEDY_MIN_ROWS rows, a plain projection below that
    model.ops = attrs.evolve(model.ops, decode_layers=decode_layers, lm_head_greedy=timed_lm_head(ops.lm_head_greedy),
                             lm_head=timed_lm_head(model.ops.lm_head))


def run_config(llm: LLM, state: dict, batch: int, context: int, tokens: int, seed: int) -> ClockedSteps:
    run = ClockedSteps(batch=batch, threads=torch.get_num_threads())
    state["run"] = run
    prompts = [[(i * 7 + j + seed) % 20000 + 100 for j in range(context)] for i in range(batch)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
    state["run"] = None
    for field in ("fused_s", "clocks", "lm_head_s", "seq_lens"):
        setattr(run, field, getattr(run, field)[SKIP_STEPS:])
    return run


def phase_costs(shape: ModelShape, batch: int, seq_lens: list[int]) -> dict[str, dict[str, float]]:
    """FLOPs and bytes each phase moves in one step (elementwise phases: none counted)."""
    itemsize, hidden, layers = shape.dtype.itemsize, shape.hidden_size, shape.num_layers
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    weights = {"qkv": (q + 2 * kv) * hidden, "o": hidden * q, "gate_up": 2 * shape.intermediate_size * hidden,
               "down": hidden * shape.intermediate_size}
    costs = {name: {"flops": 2 * batch * n * layers, "bytes": n * itemsize * layers} for name, n in weights.items()}
    step = decode_step_cost(shape, seq_lens)  # the attention's KV and FLOPs, sliding windows applied
    costs["attention"] = {"flops": step["flops"] - 2 * matmul_params(shape) * batch, "bytes": step["kv_bytes"]}
    costs["lm_head"] = {"flops": 2 * batch * shape.vocab_size * hidden, "bytes": shape.vocab_size * hidden * itemsize}
    return costs


def phase_times(run: ClockedSteps) -> tuple[dict[str, float], dict[str, float]]:
    """Per phase, the threads' mean of work + wait and of wait alone, averaged over the steps (seconds)."""
    denominator = len(run.clocks) * run.threads
    phase_s = {name: sum(t[0][p] + t[1][p] for c in run.clocks for t in c) / denominator
               for p, name in enumerate(PHASES)}
    wait_s = {name: sum(t[1][p] for c in run.clocks for t in c) / denominator for p, name in enumerate(PHASES)}
    return phase_s, wait_s


def phase_rates(run: ClockedSteps, shape: ModelShape) -> list[tuple[float, float]]:
    """(FLOP/s, bytes/s) of each costed phase of a run, the lm_head too where it was timed."""
    phase_s, _ = phase_times(run)
    if run.lm_head_s:
        phase_s["lm_head"] = statistics.mean(run.lm_head_s)
    costs = phase_costs(shape, run.batch, run.seq_lens[len(run.seq_lens) // 2])
    return [(costs[name]["flops"] / s, costs[name]["bytes"] / s) for name, s in phase_s.items()
            if name in costs and s > 0]


def raised_ceilings(ceilings: dict[str, Any], rates: list[list[tuple[float, float]]]) -> dict[str, Any]:
    """The measured ceilings (best of before and after the runs), each raised to the fastest rate a phase ran at
    where that is higher: no phase runs faster than the machine, so a lower figure was measured while the machine
    ran slow (as ``bench/roofline.py`` raises its read ceiling to the fastest decode step)."""
    read, matmul = ceilings["read_bandwidth"], ceilings["matmul"]
    fastest_flops = max((f for run in rates for f, _ in run), default=0.0)
    fastest_bytes = max((b for run in rates for _, b in run), default=0.0)
    return {"read_bytes_per_s": max(read["bytes_per_s"], fastest_bytes),
            "read_source": read["reader"] if read["bytes_per_s"] >= fastest_bytes else "a phase",
            "measured_read_bytes_per_s": read["bytes_per_s"],
            "matmul_flop_per_s": max(matmul["flop_per_s"], fastest_flops),
            "matmul_source": matmul["kernel"] if matmul["flop_per_s"] >= fastest_flops else "a phase",
            "measured_matmul_flop_per_s": matmul["flop_per_s"]}


def summarize(run: ClockedSteps, shape: ModelShape, context: int, ceilings: dict[str, Any]) -> dict[str, Any]:
    steps = len(run.clocks)
    phase_s, wait_s = phase_times(run)
    fused_s = statistics.mean(run.fused_s)
    seq_lens = run.seq_lens[steps // 2]  # the middle steady step's (each step's costs grow by one position)
    costs = phase_costs(shape, run.batch, seq_lens)
    read, matmul = ceilings["read_bytes_per_s"], ceilings["matmul_flop_per_s"]
    # the lm_head runs after the fused call (None: not timed, a call of another size)
    timed = phase_s | {"lm_head": statistics.mean(run.lm_head_s) if run.lm_head_s else None}
    rows = {}
    for name, seconds in timed.items():
        row: dict[str, Any] = {"s": seconds, "wait_s": wait_s.get(name, 0.0)}
        if name in costs:
            cost = costs[name]
            floor = max(cost["flops"] / matmul, cost["bytes"] / read)
            row |= {**cost, "flop_per_s": cost["flops"] / seconds if seconds else None,
                    "bytes_per_s": cost["bytes"] / seconds if seconds else None,
                    "floor_s": floor, "over_floor": seconds / floor if seconds else None}
        rows[name] = row
    no_overlap_floor = sum(r.get("floor_s", 0.0) for r in rows.values())
    bound = roofline_bound(decode_step_cost(shape, seq_lens), read, matmul)
    return {
        "batch": run.batch,
        "context": context,
        "steps": steps,
        "fused_s": fused_s,
        "fused_median_s": statistics.median(run.fused_s),
        "phases_s": sum(phase_s.values()),
        "outside_phases_s": fused_s - sum(phase_s.values()),
        "phases": rows,
        "no_overlap_floor_s": no_overlap_floor,
        "bound": bound,
        "no_overlap_floor_over_bound": no_overlap_floor / bound["bound_s"],
        "timed_over_bound": (fused_s + (timed["lm_head"] or 0.0)) / bound["bound_s"],
    }


def run_bench(settings: Settings) -> dict[str, Any]:
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(resolve_model_dir(settings.model)), torch.float32)
    roofline = RooflineSettings(batches=settings.batches, bandwidth_mib=settings.bandwidth_mib,
                                gemm_n=settings.gemm_n, ceiling_repeats=settings.ceiling_repeats)
    print("measuring the ceilings (read bandwidth, float32 matmul rate)", flush=True)
    measured = [measure_ceilings(roofline, shape.hidden_size)]
    with tempfile.TemporaryDirectory() as tmp:
        ops, library = clocked_ops(Path(tmp))
        if not ops.has_linear:
            return {"settings": attrs.asdict(settings), "error": "no fused decode step on this CPU (it needs AVX2 or "
                    "AVX-512: linear_available() is 0)"}
        llm = LLM(model=settings.model, dtype="float32")
        state: dict[str, Any] = {"run": None}
        install(llm, ops, library, state)
        fastest_runs = []
        for batch in settings.batches:
            for context in settings.contexts:
                runs = []
                for index in range(settings.rounds):
                    print(f"batch {batch}, context {context}: round {index + 1}/{settings.rounds}", flush=True)
                    runs.append(run_config(llm, state, batch, context, settings.tokens, seed=index))
                fastest = min(runs, key=lambda r: statistics.median(r.fused_s))
                fastest_runs.append((fastest, context, [statistics.median(r.fused_s) for r in runs]))
        llm.engine.close()  # its forward thread and OpenMP pool end before the temporary build goes
    print("measuring the ceilings again", flush=True)
    measured.append(measure_ceilings(roofline, shape.hidden_size))
    ceilings = raised_ceilings(best_ceilings(*measured), [phase_rates(run, shape) for run, _, _ in fastest_runs])
    configs = [summarize(run, shape, context, ceilings) | {"round_medians_s": medians}
               for run, context, medians in fastest_runs]
    return {
        "settings": attrs.asdict(settings),
        "model": settings.model,
        "ceilings": ceilings,
        "configs": configs,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "host": platform.node(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def format_report(report: dict[str, Any]) -> str:
    if "error" in report:
        return report["error"]
    c = report["ceilings"]
    lines = [f"ceilings: read {c['read_bytes_per_s'] / 1e9:.1f} GB/s ({c['read_source']}; measured "
             f"{c['measured_read_bytes_per_s'] / 1e9:.1f}), float32 matmul {c['matmul_flop_per_s'] / 1e9:.1f} "
             f"GFLOP/s ({c['matmul_source']}; measured {c['measured_matmul_flop_per_s'] / 1e9:.1f})"]
    for cfg in report["configs"]:
        lines += ["", f"batch {cfg['batch']}, context {cfg['context']} ({cfg['steps']} steady steps; ms a step)",
                  f"{'phase':<13}{'ms':>8}{'wait':>7}{'GFLOP/s':>9}{'GB/s':>7}{'floor ms':>10}{'x floor':>9}"]
        for name, row in cfg["phases"].items():
            if row["s"] is None:
                lines.append(f"{name:<13}{'(not timed)':>15}")
                continue
            if row["s"] < 5e-6 and "floor_s" not in row:
                continue
            rate = f"{row['flop_per_s'] / 1e9:9.1f}" if row.get("flop_per_s") else f"{'':>9}"
            gbs = f"{row['bytes_per_s'] / 1e9:7.1f}" if row.get("bytes_per_s") else f"{'':>7}"
            floor = (f"{row['floor_s'] * 1e3:10.2f}{row['over_floor']:9.2f}" if "floor_s" in row else "")
            lines.append(f"{name:<13}{row['s'] * 1e3:8.2f}{row['wait_s'] * 1e3:7.2f}{rate}{gbs}{floor}")
        bound = cfg["bound"]
        lines += [
            f"fused call {cfg['fused_s'] * 1e3:.2f} ms (phases {cfg['phases_s'] * 1e3:.2f}, outside them "
            f"{cfg['outside_phases_s'] * 1e3:.2f}); with the lm_head {cfg['timed_over_bound']:.2f}x the bound",
            f"roofline bound {bound['bound_s'] * 1e3:.2f} ms (bytes {bound['memory_s'] * 1e3:.2f}, FLOPs "
            f"{bound['compute_s'] * 1e3:.2f}); phases one after the other at their floors "
            f"{cfg['no_overlap_floor_s'] * 1e3:.2f} ms = {cfg['no_overlap_floor_over_bound']:.2f}x the bound",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    defaults = Settings()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=lambda s: tuple(int(x) for x in s.split(",")), default=defaults.batches)
    parser.add_argument("--contexts", type=lambda s: tuple(int(x) for x in s.split(",")), default=defaults.contexts)
    parser.add_argument("--rounds", type=int, default=defaults.rounds)
    parser.add_argument("--quick", action="store_true", help="the demo model, small shapes: checks the script")
    parser.add_argument("--out", type=Path, default=Path("decode_phases.json"))
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else Settings(batches=args.batches, contexts=args.contexts, rounds=args.rounds)
    report = run_bench(settings)
    print(format_report(report))
    write_json(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
