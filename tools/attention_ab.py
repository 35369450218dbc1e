"""Decode attention alone: two builds of the native CPU kernels' ``paged_decode``, alternating round by round.

Why: at batch 16 and context 512 the decode step's attention reads its KV from memory at half to two-thirds of the
read ceiling, and a change to the attention kernel moves the whole step by only a few percent, which
``decode_ab.py`` resolves with about a hundred pairs a configuration. Alone, over every layer's cache, the
attention's own time shows within a minute.

The caches are laid out as the engine allocates them (``KVCache.allocate(head_major=True)``: each layer its own K
and V tensors on huge pages, blocks of 16 slots, each KV head's positions of a block together) and each sequence's
blocks are placed at random (``--placement in-order``: one after another, as a fresh engine allocates them, where
a sequence's positions of one KV head lie in runs of a block with the other heads' between). A round runs one pass
of each build, the builds taking turns, and each pass calls the attention once per layer over the whole batch;
before each pass a buffer the size of a step's weights is written, so the KV comes from memory as it does in a step
(``--hot``: one layer's cache for every call, so after the first it comes from cache, which shows the kernel's
in-core cost). Each call also pays the op's way in from
Python and the threads' wake-up (tens of microseconds), which the engine's fused step does not: compare builds, not
these times with a step's. Both builds also run one layer on the same inputs, and the report says whether they
agree bit for bit.

    python tools/attention_ab.py --a ../old/kernels/cpu --b kernels/cpu                 # smollm2's shape, batch 16, context 512
    python tools/attention_ab.py --context 128 --hot                 # HEAD against the working tree, from cache
    python tools/attention_ab.py --quick                             # small shapes: checks the script

Both folders must export every kernel ``kernels/cpu/registration.cpp`` declares (see ``_sources.py``).

Per build: the median pass, the KV read a second, the time per position and KV head on each thread (the unit the
kernel's loops work in), and the median over rounds of b's pass over a's in the same round.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _sources, when loaded by the tests

import torch  # noqa: E402
from _sources import build_ops, head_kernels, kernels_digest  # noqa: E402

from ksana.bench.results import write_json  # noqa: E402
from ksana.kernels.cpu import build  # noqa: E402
from ksana.kernels.cpu.ops import NativeCPUOps  # noqa: E402
from ksana.models.shape import ModelShape  # noqa: E402
from ksana.worker.kv_cache import KVCache  # noqa: E402

# written before each cold pass: about what a step streams between two reads of a layer's KV (smollm2's weights are
# 540 MB), so the KV is as cold as in a step on CPUs with up to that much L3
EVICT_BYTES = 512 << 20


@attrs.frozen
class Settings:
    a_kernels: Path
    b_kernels: Path
    batch: int = 16
    context: int = 512
    layers: int = 30  # smollm2's attention: 30 layers, 9 query heads, 3 KV heads of 64
    heads: int = 9
    kv_heads: int = 3
    head_dim: int = 64
    block_size: int = 16
    dtype: str = "float32"
    rounds: int = 15
    hot: bool = False
    placement: str = "random"  # or "in-order": each sequence's blocks one after another, as a fresh engine's
    seed: int = 0


def _cache(s: Settings, dtype: torch.dtype) -> tuple[KVCache, torch.Tensor]:
    """The layers' head-major caches filled with noise, and a block table placing each sequence's blocks at random
    or in order (``s.placement``)."""
    per_seq = -(-s.context // s.block_size)
    num_blocks = s.batch * per_seq
    shape = ModelShape(model_type="llama", num_layers=1 if s.hot else s.layers, hidden_size=s.heads * s.head_dim,
                       num_heads=s.heads, num_kv_heads=s.kv_heads, head_dim=s.head_dim, intermediate_size=1,
                       vocab_size=1, max_position_embeddings=s.context, sliding_windows=[None], eos_token_ids=[],
                       dtype=dtype)
    cache = KVCache.allocate(shape, num_blocks, s.block_size, dtype, "cpu", head_major=True)
    generator = torch.Generator().manual_seed(s.seed)
    for k, v in cache.layers:
        k.copy_(torch.randn(k.shape, generator=generator))
        v.copy_(torch.randn(v.shape, generator=generator))
    order = torch.arange(num_blocks) if s.placement == "in-order" else torch.randperm(num_blocks, generator=generator)
    table = order.view(s.batch, per_seq).contiguous()
    return cache, table


def run_ab(s: Settings, builds: dict[str, NativeCPUOps] | None = None) -> dict[str, Any]:
    """The rounds and the report; ``builds``: a and b already compiled from ``s``'s sources (tests reuse them)."""
    dtype = getattr(torch, s.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        if builds is None:
            builds = {name: build_ops(source, Path(tmp) / name)
                      for name, source in (("a", s.a_kernels), ("b", s.b_kernels))}
        cache, table = _cache(s, dtype)
        seq_lens = torch.full((s.batch,), s.context, dtype=torch.int64)
        query = torch.randn((s.batch, s.heads, s.head_dim), generator=torch.Generator().manual_seed(s.seed + 1),
                            dtype=torch.float32).to(dtype)
        scale = s.head_dim ** -0.5
        calls = [cache.layers[0]] * s.layers if s.hot else cache.layers
        evict = torch.empty(EVICT_BYTES // 4, dtype=torch.float32)

        def one_pass(ops: NativeCPUOps) -> float:
            if not s.hot:
                evict.fill_(1.0)
            start = time.perf_counter()
            for k, v in calls:
                ops.paged_decode_attention(query, k, v, table, seq_lens, scale)
            return time.perf_counter() - start

        outputs = {name: ops.paged_decode_attention(query, *cache.layers[0], table, seq_lens, scale)
                   for name, ops in builds.items()}
        same_bits = torch.equal(outputs["a"], outputs["b"])
        for ops in builds.values():  # warm-up: pools started, code paged in
            one_pass(ops)
        rounds = []
        for r in range(s.rounds):
            order = ("a", "b") if r % 2 == 0 else ("b", "a")
            times = {name: one_pass(builds[name]) for name in order}
            rounds.append({"a_s": times["a"], "b_s": times["b"], "b_over_a": times["b"] / times["a"]})
            print(f"round {r + 1}/{s.rounds}: a {times['a'] * 1e3:.2f} ms, b {times['b'] * 1e3:.2f} ms")
    threads = torch.get_num_threads()
    units = s.batch * s.context * s.kv_heads * s.layers  # (position, KV head) pairs a pass
    kv_bytes = 2 * units * s.head_dim * dtype.itemsize
    per_build = {}
    for name in ("a", "b"):
        median = statistics.median(r[f"{name}_s"] for r in rounds)
        per_build[name] = {"median_ms": median * 1e3, "kv_gb_per_s": kv_bytes / median / 1e9,
                           "ns_per_position_and_kv_head_a_thread": median / (units / threads) * 1e9}
    ratios = sorted(r["b_over_a"] for r in rounds)
    return {
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in attrs.asdict(s).items()},
        "sources": {name: {"path": str(path), "sha256": kernels_digest(path)}
                    for name, path in (("a", s.a_kernels), ("b", s.b_kernels))},
        "kv_bytes_a_pass": kv_bytes,
        "builds": per_build,
        "b_over_a": {"median": statistics.median(ratios), "q1": ratios[len(ratios) // 4],
                     "q3": ratios[(3 * len(ratios)) // 4], "n": len(ratios)},
        "same_bits": same_bits,
        "rounds": rounds,
        "torch": torch.__version__,
        "threads": threads,
        "host": platform.node(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def print_report(report: dict[str, Any]) -> None:
    s = report["settings"]
    where = "one layer's cache, from cache" if s["hot"] else f"{s['layers']} layers' caches, from memory"
    print(f"\nbatch {s['batch']}, context {s['context']}, {s['dtype']}, {where}, blocks {s['placement']}; "
          f"{report['kv_bytes_a_pass'] / 1e6:.1f} MB of KV a pass, {report['threads']} threads")
    print(f"{'build':<6} {'ms a pass':>10} {'GB/s':>8} {'ns per position and KV head a thread':>38}  source")
    for name, b in report["builds"].items():
        print(f"{name:<6} {b['median_ms']:>10.2f} {b['kv_gb_per_s']:>8.1f} "
              f"{b['ns_per_position_and_kv_head_a_thread']:>38.1f}  {report['sources'][name]['path']}")
    r = report["b_over_a"]
    print(f"b/a in the same round: median {r['median']:.3f} (quartiles {r['q1']:.3f} / {r['q3']:.3f}, "
          f"{r['n']} rounds); same bits on one layer: {report['same_bits']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", type=Path, help="the baseline kernels folder (default: HEAD's kernels/cpu)")
    parser.add_argument("--b", type=Path, default=build.HERE, help="the candidate (default: the working tree's)")
    defaults = Settings(a_kernels=Path(), b_kernels=Path())
    for field in ("batch", "context", "layers", "heads", "kv_heads", "head_dim", "block_size", "rounds"):
        parser.add_argument(f"--{field.replace('_', '-')}", type=int, default=getattr(defaults, field))
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=defaults.dtype)
    parser.add_argument("--hot", action="store_true", help="one layer's cache for every call (from cache)")
    parser.add_argument("--placement", choices=("random", "in-order"), default=defaults.placement,
                        help="each sequence's blocks at random addresses, or one after another (a fresh engine)")
    parser.add_argument("--quick", action="store_true", help="batch 4, context 64, 2 layers, 3 rounds")
    parser.add_argument("--out", type=Path, default=Path("attention_ab.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        a_kernels = args.a or head_kernels(Path(tmp))
        fields = {f: getattr(args, f) for f in ("batch", "context", "layers", "heads", "kv_heads", "head_dim",
                                                 "block_size", "rounds", "dtype", "hot", "placement")}
        if args.quick:
            fields.update(batch=4, context=64, layers=2, rounds=3)
        report = run_ab(Settings(a_kernels=a_kernels, b_kernels=args.b, **fields))
        report["sources"]["a"]["path"] = "HEAD:kernels/cpu" if args.a is None else str(args.a)
    print_report(report)
    write_json(report, args.out)


if __name__ == "__main__":
    main()
