"""Two builds of the native CPU kernels in one engine: the fused decode step of each, alternating step by step.

Why step by step: a shared or virtual machine's speed can drift by tens of percent within minutes, so whole runs
alternated run by run need many rounds to show a 1-2% change. Neighbouring decode steps of one ``generate`` call
have the same shapes (the context grows by one) and nearly the same machine state; with the two builds taking
turns, each pair of neighbours compares them under the same conditions, and the median ratio over a hundred pairs
resolves about 1%.

The tool also runs both builds on one captured step and says whether they give the same bits (hidden states,
residual and KV cache), which a change meant to be bit-identical should.

    python tools/decode_ab.py                                   # HEAD's kernels against the working tree's
    python tools/decode_ab.py --a ../old/kernels/cpu --b kernels/cpu --batch 16 --context 512
    python tools/decode_ab.py --quick                           # the demo model, small shapes: checks the script

Both folders must export every kernel ``kernels/cpu/registration.cpp`` declares (see ``_sources.py``).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _sources, when loaded by the tests
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from _sources import build_ops, head_kernels, kernels_digest  # noqa: E402

from ksana import LLM, SamplingParams  # noqa: E402
from ksana.bench.results import write_json  # noqa: E402
from ksana.kernels.cpu import build  # noqa: E402
from ksana.kernels.cpu.ops import NativeCPUOps  # noqa: E402

SKIP_STEPS = 2  # each generate call's first decode steps (caches and pools settling)


@attrs.frozen
class Settings:
    a_kernels: Path
    b_kernels: Path
    model: str = "smollm2"
    dtype: str = "float32"
    batch: int = 16
    context: int = 128
    tokens: int = 40
    rounds: int = 6


def _pairs(calls: list[tuple[str, float]]) -> list[float]:
    """b's time over a's for each neighbouring pair of calls. The builds take turns on every fused call, and only
    the batch's own calls are timed; a pair that is not one of each (a call of another size between them) is
    left out."""
    ratios = []
    for first, second in zip(calls[0::2], calls[1::2], strict=False):
        times = dict((first, second))
        if len(times) == 2:
            ratios.append(times["b"] / times["a"])
    return ratios


def _same_bits(builds: dict[str, NativeCPUOps], step: tuple) -> bool:
    """Both builds on the captured step, each from the same cache rows: equal hidden states and residual, and
    equal K/V rows written at the step's slots."""
    model, hidden, cos, sin, meta = step
    caches = [c for layer in model.layers for c in (layer.k_cache, layer.v_cache)]
    at = (meta.slot_mapping // meta.block_size, meta.slot_mapping % meta.block_size)  # either cache layout
    saved = [c[at].clone() for c in caches]
    results = {}
    for tag, ops in builds.items():
        for cache, rows in zip(caches, saved, strict=True):
            cache[at] = rows
        out = ops.decode_layers(model, hidden.clone(), cos, sin, meta)
        results[tag] = [t.clone() for t in out] + [c[at].clone() for c in caches]
    return all(torch.equal(x, y) for x, y in zip(results["a"], results["b"], strict=True))


def run_ab(settings: Settings) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        builds = {tag: build_ops(source, Path(tmp) / tag)
                  for tag, source in (("a", settings.a_kernels), ("b", settings.b_kernels))}
        if not builds["a"].has_linear:
            return {"settings": _settings_json(settings), "error": "no fused decode step on this CPU (it needs "
                    "AVX2 or AVX-512: linear_available() is 0)"}
        state: dict[str, Any] = {"turn": "a", "calls": [], "step": None}

        def alternating(model, hidden, cos, sin, meta):
            tag = state["turn"]
            state["turn"] = "b" if tag == "a" else "a"
            if hidden.shape[0] == settings.batch and state["step"] is None:
                state["step"] = (model, hidden.clone(), cos.clone(), sin.clone(), meta)
            start = time.perf_counter()
            out = builds[tag].decode_layers(model, hidden, cos, sin, meta)
            if hidden.shape[0] == settings.batch:
                state["calls"].append((tag, time.perf_counter() - start))
            return out

        llm = LLM(model=settings.model, dtype=settings.dtype)
        engine_model = llm.engine.model  # its ops' decode_layers, swapped for the alternating pair of builds
        engine_ops = engine_model.ops
        engine_model.ops = attrs.evolve(engine_ops, decode_layers=alternating)
        try:
            rounds = []
            for index in range(settings.rounds):
                state["calls"], state["turn"] = [], "ab"[index % 2]
                prompts = [[(i * 7 + j + index) % 20000 + 100 for j in range(settings.context)]
                           for i in range(settings.batch)]
                params = SamplingParams(temperature=0.0, max_tokens=settings.tokens, ignore_eos=True)
                llm.generate(prompts, params, use_tqdm=False)
                calls = state["calls"][SKIP_STEPS:]
                if len(calls) % 2:
                    calls = calls[:-1]
                rounds.append({
                    "a_ms": statistics.median(t for tag, t in calls if tag == "a") * 1e3,
                    "b_ms": statistics.median(t for tag, t in calls if tag == "b") * 1e3,
                    "pair_ratios": _pairs(calls),
                })
                print(f"round {index + 1}/{settings.rounds}: a {rounds[-1]['a_ms']:.2f} ms, "
                      f"b {rounds[-1]['b_ms']:.2f} ms", flush=True)
            same_bits = _same_bits(builds, state["step"])
        finally:
            engine_model.ops = engine_ops
    ratios = [r for rnd in rounds for r in rnd["pair_ratios"]]
    q1, median, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    return {
        "settings": _settings_json(settings),
        "sources": {tag: {"path": str(src), "sha256": kernels_digest(src)[:16]}
                    for tag, src in (("a", settings.a_kernels), ("b", settings.b_kernels))},
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "host": platform.node(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "rounds": rounds,
        "pairs": {"n": len(ratios), "median_b_over_a": median, "q1": q1, "q3": q3},
        "same_bits": same_bits,
    }


def _settings_json(settings: Settings) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Path) else v for k, v in attrs.asdict(settings).items()}


def print_report(report: dict[str, Any]) -> None:
    if "error" in report:
        print(report["error"])
        return
    s, p = report["settings"], report["pairs"]
    print(f"\nfused decode step, {s['model']} {s['dtype']}, batch {s['batch']}, context {s['context']} "
          f"(ms, medians of each round's steps)")
    print("round      a        b      b/a")
    for i, r in enumerate(report["rounds"], 1):
        print(f"{i:5d} {r['a_ms']:8.2f} {r['b_ms']:8.2f} {r['b_ms'] / r['a_ms']:8.3f}")
    print(f"neighbouring steps: b/a median {p['median_b_over_a']:.4f} (quartiles {p['q1']:.4f} / {p['q3']:.4f}, "
          f"{p['n']} pairs); same bits on a captured step: {report['same_bits']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", type=Path, help="the baseline kernels folder (default: HEAD's kernels/cpu)")
    parser.add_argument("--b", type=Path, default=build.HERE, help="the candidate (default: the working tree's)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--quick", action="store_true", help="the demo model, small shapes: checks the script")
    parser.add_argument("--out", type=Path, default=Path("decode_ab.json"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        a_kernels = args.a or head_kernels(Path(tmp))
        settings = Settings(a_kernels=a_kernels, b_kernels=args.b, dtype=args.dtype, batch=args.batch,
                            context=args.context, rounds=args.rounds)
        if args.quick:
            settings = attrs.evolve(settings, model="demo", batch=min(args.batch, 3), context=24, tokens=8, rounds=2)
        report = run_ab(settings)
    print_report(report)
    write_json(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
