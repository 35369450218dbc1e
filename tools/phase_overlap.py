"""Would the fused decode step gain from running its attention beside its projections, one thread each?

The roofline bound of ``bench/roofline.py`` assumes the step's reads and arithmetic overlap; in the engine's fused
decode step (``decode_layers`` in ``kernels/cpu/decode_layers.cpp``) every phase runs on all threads, one phase after the
other.
On two cores the other schedule is to give each core one kind of work: one thread runs a layer's attention (reading
the KV cache) while the other runs projections (streaming weights through FMAs), as NanoFlow-style pipelines over
two halves of the batch do. That pays where each phase gains little from a second thread (the attention held by
memory latency, the projections by the FMAs) and the two do not slow each other down, so that one thread each,
side by side, finishes before both threads on each in turn.

This captures the engine's first decode step at the full batch (its packed weights, its KV cache and block tables)
and times over every layer, in rounds that rotate the order:

- the engine's fused call for the step, for reference (the two phases below are most of it);
- the attention on all threads and on one (``paged_decode`` over each layer's cache);
- the projections on all threads, on one, and on one with the batch in two halves (a pipeline over half batches
  streams the weights twice);
- both at once on two threads of this process (the operators release the GIL): the attention on one thread, the
  projections on the other, over the whole batch and in halves.

Sequential is what the step does now (attention, then projections, on all threads); overlapped / sequential is
what a pipeline could at best reach: the whole batch side by side ignores the dependencies between a layer's
phases (only the halves can keep them), and neither counts the norms.

    python tools/phase_overlap.py                      # smollm2, batch 16, context 512
    python tools/phase_overlap.py --batch 16 --context 128 --rounds 9
    python tools/phase_overlap.py --quick              # the demo model, small shapes: checks the script
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from kv_layout_ab import Settings, capture_step  # noqa: E402

from ksana import LLM  # noqa: E402
from ksana.bench.results import write_json  # noqa: E402

CASES = ("fused_step", "attention_all", "attention_one", "projections_all", "projections_one",
         "projections_one_halves", "overlapped", "overlapped_halves")
DEFAULTS = Settings(rounds=7)  # kv_layout_ab's settings: the same model, dtype, batch and context
QUICK = Settings(model="demo", batch=3, context=24, rounds=2)


class StepPhases:
    """A captured decode step's attention and projections over every layer, on a chosen number of threads.

    The kernels are called as the build's operators directly, with the tensors prepared once, so that a pass is
    mostly the kernels' time (about 150 calls a pass for smollm2; the operators release the GIL while they run).
    Each pass sets its thread's OpenMP thread count first: the operators run on the calling thread's.
    """

    def __init__(self, llm: LLM, settings: Settings) -> None:
        layers, hidden, cos, sin, meta = capture_step(llm, settings)
        self._native = native = llm.engine.model.ops.decode_layers.__self__
        self._step = (layers, hidden, cos, sin, meta)
        dtype = hidden.dtype
        self._kernels = native.library  # the bench drives the operators without the wrappers' checks on purpose
        self.batch = batch = hidden.shape[0]
        generator = torch.Generator().manual_seed(0)
        self.query = torch.randn(batch, layers.num_heads, layers.head_dim, generator=generator).to(dtype)
        self.block_tables, self.seq_lens = meta.block_tables, meta.seq_lens
        self.layers = layers.layers
        self.num_heads, self.num_kv_heads, self.head_dim = layers.num_heads, layers.num_kv_heads, layers.head_dim
        self.scale = layers.scale
        self.weights = [w for layer in self.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        widths = {w.in_features for w in self.weights}
        self.inputs = {k: torch.randn(batch, k, generator=generator).to(dtype) for k in widths}
        self.outputs = [torch.empty(batch, w.out_features, dtype=dtype) for w in self.weights]

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V one pass of the attention reads."""
        size = self.query.element_size() * self.num_kv_heads * self.head_dim * 2
        lens = self.seq_lens.tolist()
        return sum(size * min(n, layer.sliding_window or n) for layer in self.layers for n in lens)

    def fused_step(self) -> None:
        """The engine's own call for the step: every phase of every layer on all threads (it also stores the
        step's K and V, into the same slots each time)."""
        layers, hidden, cos, sin, meta = self._step
        self._native.decode_layers(layers, hidden.clone(), cos, sin, meta)

    def attention(self, threads: int) -> None:
        torch.set_num_threads(threads)
        q, decode = self.query, self._kernels.paged_decode
        for layer in self.layers:
            decode(q, layer.k_cache, layer.v_cache, self.block_tables, self.seq_lens, self.scale,
                   layer.sliding_window or 0)

    def projections(self, threads: int, parts: int = 1) -> None:
        """The four projections of every layer over the batch in ``parts`` row ranges (biases left out: a few
        thousand adds next to millions of multiply-adds)."""
        torch.set_num_threads(threads)
        bounds = [self.batch * i // parts for i in range(parts + 1)]
        linear = self._kernels.packed_linear
        for weight, out in zip(self.weights, self.outputs, strict=True):
            x = self.inputs[weight.in_features]
            for r0, r1 in zip(bounds[:-1], bounds[1:], strict=True):
                if r1 > r0:
                    out[r0:r1].copy_(linear(x[r0:r1], weight.packed, None, weight.out_features))

    def overlapped(self, parts: int = 1) -> None:
        """The attention on one thread and the projections on another, at the same time."""
        workers = [threading.Thread(target=self.attention, args=(1,)),
                   threading.Thread(target=self.projections, args=(1, parts))]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_bench(settings: Settings) -> dict[str, Any]:
    llm = LLM(model=settings.model, dtype=settings.dtype)
    if llm.engine.model.ops.decode_layers is None:
        return {"settings": attrs.asdict(settings), "error": "no fused decode step on this CPU (it needs AVX2 or "
                "AVX-512)"}
    phases = StepPhases(llm, settings)
    # the engine's forward thread goes with it, and its OpenMP pool: with two pools on two cores libgomp stops
    # spinning between regions (see ksana/worker/fresh_thread.py), and every call here would wake its team
    llm.engine.close()
    threads = torch.get_num_threads()
    cases: dict[str, Callable[[], None]] = {
        "fused_step": phases.fused_step,
        "attention_all": lambda: phases.attention(threads),
        "attention_one": lambda: phases.attention(1),
        "projections_all": lambda: phases.projections(threads),
        "projections_one": lambda: phases.projections(1),
        "projections_one_halves": lambda: phases.projections(1, parts=2),
        "overlapped": lambda: phases.overlapped(),
        "overlapped_halves": lambda: phases.overlapped(parts=2),
    }
    for fn in cases.values():  # one untimed pass of each: first-touch and cold-code costs out of the rounds
        fn()
    # the projections' bits do not depend on the threads or the rows a call gets, so the overlapped runs, from
    # zeroed outputs, must give what one call on all threads gave: they did the work
    phases.projections(threads)
    reference = [out.clone() for out in phases.outputs]
    same_bits = True
    for parts in (1, 2):
        for out in phases.outputs:
            out.zero_()
        phases.overlapped(parts)
        same_bits &= all(torch.equal(a, b) for a, b in zip(reference, phases.outputs, strict=True))
    times: dict[str, list[float]] = {name: [] for name in CASES}
    for index in range(settings.rounds):
        order = CASES[index % len(CASES):] + CASES[:index % len(CASES)]
        for name in order:
            times[name].append(_timed(cases[name]))
        print(f"round {index + 1}/{settings.rounds}: " + ", ".join(
            f"{name} {times[name][-1] * 1e3:.1f}" for name in CASES) + " ms", flush=True)
    median_ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    sequential = median_ms["attention_all"] + median_ms["projections_all"]
    return {
        "settings": attrs.asdict(settings),
        "torch": torch.__version__,
        "threads": threads,
        "host": platform.node(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "kv_bytes": phases.kv_bytes,
        "attention_all_bytes_per_s": phases.kv_bytes / median_ms["attention_all"] * 1e3,
        "attention_one_bytes_per_s": phases.kv_bytes / median_ms["attention_one"] * 1e3,
        "median_ms": median_ms,
        "rounds_ms": {name: [t * 1e3 for t in ts] for name, ts in times.items()},
        "sequential_ms": sequential,
        "overlapped_over_sequential": median_ms["overlapped"] / sequential,
        "overlapped_halves_over_sequential": median_ms["overlapped_halves"] / sequential,
        "sequential_over_fused_step": sequential / median_ms["fused_step"],
        "overlapped_over_fused_step": median_ms["overlapped"] / median_ms["fused_step"],
        "overlapped_halves_over_fused_step": median_ms["overlapped_halves"] / median_ms["fused_step"],
        "attention_one_over_all": median_ms["attention_one"] / median_ms["attention_all"],
        "projections_one_over_all": median_ms["projections_one"] / median_ms["projections_all"],
        "same_bits": same_bits,
    }


def print_report(report: dict[str, Any]) -> None:
    if "error" in report:
        print(report["error"])
        return
    s, ms = report["settings"], report["median_ms"]
    print(f"\n{s['model']} {s['dtype']}, batch {s['batch']}, context {s['context']}, every layer; medians of "
          f"{s['rounds']} rounds, {report['threads']} threads:\n")
    print("| work | threads | ms |")
    print("|---|---|---|")
    rows = [("the engine's fused step (every phase)", "all", "fused_step"), ("attention", "all", "attention_all"),
            ("attention", "one", "attention_one"),
            ("projections", "all", "projections_all"), ("projections", "one", "projections_one"),
            ("projections, batch in halves", "one", "projections_one_halves"),
            ("attention beside projections", "one each", "overlapped"),
            ("attention beside projections in halves", "one each", "overlapped_halves")]
    for work, threads, key in rows:
        print(f"| {work} | {threads} | {ms[key]:.1f} |")
    print(f"| **sequential** (attention, then projections) | all | **{report['sequential_ms']:.1f}** |")
    print(f"\noverlapped / fused step: {report['overlapped_over_fused_step']:.3f} (halves "
          f"{report['overlapped_halves_over_fused_step']:.3f}); overlapped / sequential: "
          f"{report['overlapped_over_sequential']:.3f} (halves {report['overlapped_halves_over_sequential']:.3f}); "
          f"sequential / fused step: {report['sequential_over_fused_step']:.3f}; one thread / all: attention "
          f"{report['attention_one_over_all']:.2f}x, projections {report['projections_one_over_all']:.2f}x "
          f"(the attention reads {report['attention_all_bytes_per_s'] / 1e9:.1f} GB/s on all threads, "
          f"{report['attention_one_bytes_per_s'] / 1e9:.1f} on one); "
          f"projection bits the same in every run: {report['same_bits']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=DEFAULTS.batch)
    parser.add_argument("--context", type=int, default=DEFAULTS.context)
    parser.add_argument("--rounds", type=int, default=DEFAULTS.rounds)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--quick", action="store_true", help="the demo model, small shapes: checks the script")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    for name in ("batch", "context", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    settings = (attrs.evolve(QUICK, dtype=args.dtype) if args.quick else
                attrs.evolve(DEFAULTS, dtype=args.dtype, batch=args.batch, context=args.context, rounds=args.rounds))
    report = run_bench(settings)
    print_report(report)
    write_json(report, args.out or Path("phase_overlap.json"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
