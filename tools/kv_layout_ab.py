"""The fused CPU decode step on a head-major KV cache against the same step on a slot-major copy of it.

The engine allocates head-major caches for the native CPU kernels (see ``KVCache``). This measures what that layout
buys: one build, one captured decode step of a real ``generate`` call, run over the engine's own (head-major) cache
and over a slot-major copy with the same values, the two taking turns (a, b, b, a) so that the machine's drift
cancels. Both must give the same bits: the layout changes where values lie, not what is computed.

    python tools/kv_layout_ab.py --batch 16 --context 512
    python tools/kv_layout_ab.py --dtype bfloat16
    python tools/kv_layout_ab.py --quick        # the demo model, small shapes: checks the script
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import attrs

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from ksana import LLM, SamplingParams  # noqa: E402
from ksana.bench.results import write_json  # noqa: E402


@attrs.frozen
class Settings:
    model: str = "smollm2"
    dtype: str = "float32"
    batch: int = 16
    context: int = 512
    rounds: int = 25


def capture_step(llm: LLM, settings: Settings) -> tuple:
    """The arguments of the engine's first fused decode step at the full batch."""
    model = llm.engine.model
    ops = model.ops
    captured: list[tuple] = []

    def capture(layers, hidden, cos, sin, meta):
        if hidden.shape[0] == settings.batch and not captured:
            captured.append((layers, hidden.clone(), cos.clone(), sin.clone(), meta))
        return ops.decode_layers(layers, hidden, cos, sin, meta)

    model.ops = attrs.evolve(ops, decode_layers=capture)
    try:
        prompts = [[(i * 7 + j) % 20000 + 100 for j in range(settings.context)] for i in range(settings.batch)]
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    finally:
        model.ops = ops
    return captured[0]


def run_ab(settings: Settings) -> dict[str, Any]:
    llm = LLM(model=settings.model, dtype=settings.dtype)
    if llm.engine.model.ops.decode_layers is None:
        return {"settings": attrs.asdict(settings), "error": "no fused decode step on this CPU (it needs AVX2 or "
                "AVX-512)"}
    head_major, hidden, cos, sin, meta = capture_step(llm, settings)
    slot_major = attrs.evolve(head_major, layers=tuple(
        attrs.evolve(layer, k_cache=layer.k_cache.contiguous(), v_cache=layer.v_cache.contiguous())
        for layer in head_major.layers))
    native = llm.engine.model.ops.decode_layers.__self__
    at = (meta.slot_mapping // meta.block_size, meta.slot_mapping % meta.block_size)

    def step(layers) -> tuple[float, list[torch.Tensor]]:
        native._table_of = None  # the op caches one model's address table; these take turns
        start = time.perf_counter()
        out = native.decode_layers(layers, hidden.clone(), cos, sin, meta)
        elapsed = time.perf_counter() - start
        return elapsed, [*out, *(c[at] for layer in layers.layers for c in (layer.k_cache, layer.v_cache))]

    same_bits = all(torch.equal(x, y) for x, y in zip(step(slot_major)[1], step(head_major)[1], strict=True))
    slot_ms, head_ms, ratios = [], [], []
    for index in range(settings.rounds):
        a1, b1, b2, a2 = step(slot_major)[0], step(head_major)[0], step(head_major)[0], step(slot_major)[0]
        slot_ms += [a1 * 1e3, a2 * 1e3]
        head_ms += [b1 * 1e3, b2 * 1e3]
        ratios += [b1 / a1, b2 / a2]
        print(f"round {index + 1}/{settings.rounds}: slot-major {a1 * 1e3:.2f} / {a2 * 1e3:.2f} ms, head-major "
              f"{b1 * 1e3:.2f} / {b2 * 1e3:.2f} ms", flush=True)
    llm.engine.close()
    q1, median, q3 = statistics.quantiles(ratios, n=4)
    return {
        "settings": attrs.asdict(settings),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "host": platform.node(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "slot_major_ms": statistics.median(slot_ms),
        "head_major_ms": statistics.median(head_ms),
        "pairs": {"n": len(ratios), "median_head_over_slot": median, "q1": q1, "q3": q3},
        "same_bits": same_bits,
        # the engine's own cache is the head-major one, and the copy really is the other layout
        "layouts_differ": (not head_major.layers[0].k_cache.is_contiguous()
                           and slot_major.layers[0].k_cache.is_contiguous()),
    }


def print_report(report: dict[str, Any]) -> None:
    if "error" in report:
        print(report["error"])
        return
    s, p = report["settings"], report["pairs"]
    print(f"\nfused decode step, {s['model']} {s['dtype']}, batch {s['batch']}, context {s['context']}: slot-major "
          f"{report['slot_major_ms']:.2f} ms, head-major {report['head_major_ms']:.2f} ms (medians)")
    print(f"head-major / slot-major: median {p['median_head_over_slot']:.3f} (quartiles {p['q1']:.3f} / "
          f"{p['q3']:.3f}, {p['n']} pairs); same bits: {report['same_bits']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--quick", action="store_true", help="the demo model, small shapes: checks the script")
    parser.add_argument("--out", type=Path, default=Path("kv_layout_ab.json"))
    args = parser.parse_args(argv)
    for name in ("batch", "context", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    settings = Settings(dtype=args.dtype, batch=args.batch, context=args.context, rounds=args.rounds)
    if args.quick:
        settings = Settings(model="demo", dtype=args.dtype, batch=min(args.batch, 3), context=24, rounds=2)
    report = run_ab(settings)
    print_report(report)
    write_json(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
