"""Kernel benchmark: each fast kernel against its torch reference, against the device's measured ceilings.

    python bench/kernel_ops.py           # CUDA: Triton against torch; CPU: the native C++ kernels against torch
    python bench/kernel_ops.py --quick   # shapes 8x smaller, fewer repeats: checks the script

A full run writes ``bench/results/kernels_<machine kind>.json`` (the GPU's kind where there is one), a ``--quick``
one ``kernels_quick.json``. (The script is not called ``kernels.py``: run from ``bench/``, that name would shadow
the ``kernels`` package.)

The ceilings are measured here, not quoted from a datasheet: a large device-to-device copy (bytes read plus
bytes written per second) and a large matmul in the benchmark dtype. Memory-bound ops report the bandwidth of
the bytes they must move at least once (inputs read, outputs written; for decode attention the visible K/V);
prefill attention reports FLOP/s of its QK^T and PV products over the visible (causal, windowed) pairs.
``% ceil`` is the fastest implementation's share of the matching ceiling. Shapes are Llama-3-8B-like (32 query
heads, 8 KV heads, head_dim 128, hidden 4096, intermediate 14336, 16-token blocks).

Without CUDA the Triton kernels are not timed: the CPU can only run them in Triton's interpreter, which is
four orders of magnitude slower than any real kernel, so its timings mean nothing. The CPU's fast column is
``kernels/cpu`` instead (C + OpenMP; prefill attention there is the reference's SDPA, so it times alike).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from ksana.bench.results import default_out, write_json  # noqa: E402
from ksana.kernels import activation, attention, norm, rotary  # noqa: E402
from ksana.kernels.attention_metadata import AttentionMetadata  # noqa: E402

RESULTS = Path(__file__).parent / "results"

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
HIDDEN, INTERMEDIATE, BLOCK_SIZE = 4096, 14336, 16


@attrs.frozen
class Case:
    """One op at one shape: the reference and the fast kernel's call (Triton / native C++), and the work it does."""

    op: str
    shape: str
    reference: Callable[[], object]
    kernel: Callable[[], object] | None
    bytes: float = 0.0  # bytes the op must move (memory-bound ops)
    flops: float = 0.0  # FLOPs of the op (compute-bound ops)


# ---- timing ----


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, min_seconds: float, max_reps: int) -> float:
    """Median milliseconds of one call, after a warmup call (which also compiles Triton kernels)."""
    fn()
    _sync(device)
    started = time.perf_counter()
    fn()
    _sync(device)
    once = time.perf_counter() - started
    reps = max(3, min(max_reps, int(min_seconds / max(once, 1e-6))))
    samples = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            started = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - started) * 1e3)
    return statistics.median(samples)


def measure_ceilings(device: torch.device, dtype: torch.dtype, quick: bool) -> dict[str, float]:
    """Copy bandwidth (GB/s) and matmul throughput (TFLOP/s) this device reaches with plain torch."""
    on_gpu = device.type == "cuda"
    num_bytes = (2 << 30 if on_gpu else 256 << 20) // (8 if quick else 1)
    src = torch.empty(num_bytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src), device, 0.3, 50)
    n = (8192 if on_gpu else 2048) // (2 if quick else 1)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    matmul_ms = time_ms(lambda: a @ b, device, 0.3, 50)
    return {
        "copy_gb_s": 2 * num_bytes / copy_ms / 1e6,
        "matmul_tflop_s": 2 * n**3 / matmul_ms / 1e9,
        "copy_bytes": num_bytes,
        "matmul_n": n,
    }


# ---- cases ----


def _paged_batch(rows: list[tuple[int, int]], device: torch.device, dtype: torch.dtype):
    """Cache with room for ``rows`` ``(q_len, seq_len)``, fresh q/k/v for the new tokens, and the metadata."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    blocks = [-(-s // BLOCK_SIZE) for _, s in rows]
    perm = (torch.randperm(sum(blocks), generator=gen) + 1).tolist()  # scattered blocks; 0 is table padding
    tables, slots, start = [], [], 0
    for (q_len, seq_len), n in zip(rows, blocks, strict=True):
        table = perm[start : start + n]
        start += n
        tables.append(table + [0] * (max(blocks) - n))
        slots += [
            table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(seq_len - q_len, seq_len)
        ]
    cache_shape = (sum(blocks) + 1, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(cache_shape, device=device).to(dtype)
    v_cache = torch.randn(cache_shape, device=device).to(dtype)
    num_tokens = sum(q for q, _ in rows)
    query = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, device=device).to(dtype)
    key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, device=device).to(dtype)
    value = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, device=device).to(dtype)
    query_lens, seq_lens = [q for q, _ in rows], [s for _, s in rows]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device),
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], device=device),
        seq_lens=torch.tensor(seq_lens, device=device),
        block_tables=torch.tensor(tables, device=device),
        block_size=BLOCK_SIZE,
        num_decodes=sum(1 for q in query_lens if q == 1),
        max_seq_len=max(seq_lens),
        query_lens_list=query_lens,
        seq_lens_list=seq_lens,
    )
    return query, key, value, k_cache, v_cache, meta


def _visible_pairs(q_len: int, seq_len: int, window: int | None) -> int:
    """(query, key) pairs a causal, optionally windowed, attention computes for one sequence."""
    context = seq_len - q_len
    return sum(min(context + i + 1, window or seq_len) for i in range(q_len))


def _over_packed_weights(native) -> Callable:
    """The native linear called like ``F.linear``: each weight is packed once, on first use, as the loader packs
    a model's weights, so the timing is the matmul's alone."""
    packed: dict[int, object] = {}

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if weight.data_ptr() not in packed:
            packed[weight.data_ptr()] = native.pack_weight(weight)
        return native.linear(x, packed[weight.data_ptr()], bias)

    return linear


def _native_cpu_kernels() -> dict[str, Callable] | None:
    from ksana.kernels.backends import cpu_ops
    from ksana.kernels.cpu import load_library
    from ksana.kernels.cpu.ops import NativeCPUOps

    library = load_library()
    if library is None:
        return None
    native = NativeCPUOps(library)
    linear = {"linear": _over_packed_weights(native)} if native.has_linear else {}  # AVX2 / AVX-512; BLAS elsewhere
    return linear | {
        "rms_norm": native.rms_norm,
        "fused_add_rms_norm": native.fused_add_rms_norm,
        "apply_rotary": native.apply_rotary,
        "silu_and_mul": native.silu_and_mul,
        "store_kv_cache": native.store_kv_cache,
        "paged_decode_attention": native.paged_decode_attention,
        "paged_attention": cpu_ops().paged_attention,
    }


def build_cases(device: torch.device, dtype: torch.dtype, quick: bool, with_triton: bool) -> list[Case]:
    tr = _native_cpu_kernels() if device.type == "cpu" else None
    if with_triton:
        from ksana.kernels.triton import activation as t_activation
        from ksana.kernels.triton import attention as t_attention
        from ksana.kernels.triton import cache as t_cache
        from ksana.kernels.triton import norm as t_norm
        from ksana.kernels.triton import rotary as t_rotary

        tr = {
            "rms_norm": t_norm.rms_norm,
            "fused_add_rms_norm": t_norm.fused_add_rms_norm,
            "apply_rotary": t_rotary.apply_rotary,
            "silu_and_mul": t_activation.silu_and_mul,
            "store_kv_cache": t_cache.store_kv_cache,
            "paged_decode_attention": t_attention.paged_decode_attention,
            "paged_attention": t_attention.paged_attention,
        }
    div = 8 if quick else 1
    if device.type != "cuda":
        div *= 4  # the CPU references are slow: keep a run to a minute
    es = torch.empty(0, dtype=dtype).element_size()
    randn = lambda *shape: torch.randn(*shape, device=device).to(dtype)  # noqa: E731
    cases: list[Case] = []

    def add(op: str, shape: str, args: tuple, ref_fn: Callable, num_bytes: float = 0.0, flops: float = 0.0):
        kernel_fn = tr.get(op) if tr else None
        cases.append(
            Case(
                op,
                shape,
                lambda: ref_fn(*args),
                (lambda: kernel_fn(*args)) if kernel_fn else None,
                num_bytes,
                flops,
            )
        )

    tokens = 8192 // div
    x, residual, weight = randn(tokens, HIDDEN), randn(tokens, HIDDEN), randn(HIDDEN)
    add("rms_norm", f"{tokens}x{HIDDEN}", (x, weight, 1e-5), norm.rms_norm, 2 * x.numel() * es)
    add(
        "fused_add_rms_norm",
        f"{tokens}x{HIDDEN}",
        (x, residual, weight, 1e-5),
        norm.fused_add_rms_norm,
        4 * x.numel() * es,
    )

    qkv = randn(tokens, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM)
    qk = qkv[:, : (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM].view(tokens, NUM_HEADS + NUM_KV_HEADS, HEAD_DIM)
    inv_freq = 1.0 / (
        500000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32, device=device) / HEAD_DIM)
    )
    positions = torch.arange(tokens, device=device)
    for is_neox, layout in ((True, "neox"), (False, "gptj")):
        cos, sin = rotary.rotary_cos_sin(positions, inv_freq, 1.0, dtype, is_neox)
        add(
            "apply_rotary",
            f"{tokens}x{NUM_HEADS + NUM_KV_HEADS}x{HEAD_DIM} {layout}",
            (qk, cos, sin, is_neox),
            rotary.apply_rotary,
            (2 * qk.numel() + 2 * cos.numel()) * es,
        )

    gate_up = randn(tokens, 2 * INTERMEDIATE)
    add(
        "silu_and_mul",
        f"{tokens}x{2 * INTERMEDIATE}",
        (gate_up,),
        activation.silu_and_mul,
        1.5 * gate_up.numel() * es,
    )

    # Projections: decode-sized (the weight is read once per call) and a prefill chunk (arithmetic-bound).
    projection = randn(HIDDEN, HIDDEN)
    for num_rows in (1, 16, 64, 512):
        add(
            "linear",
            f"{num_rows}x{HIDDEN} @ {HIDDEN}x{HIDDEN}",
            (randn(num_rows, HIDDEN), projection),
            F.linear,
            projection.numel() * es,
            2.0 * num_rows * projection.numel(),
        )

    kv_shape = (tokens, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.zeros(
        tokens // BLOCK_SIZE + 1, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=device, dtype=dtype
    )
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(tokens, device=device)
    add(
        "store_kv_cache",
        f"{tokens} tokens",
        (randn(*kv_shape), randn(*kv_shape), k_cache, v_cache, slots),
        attention.store_kv_cache,
        4 * tokens * NUM_KV_HEADS * HEAD_DIM * es,
    )

    scale = HEAD_DIM**-0.5
    # The last: one long sequence, whose KV heads' positions split across the threads (flash-decoding).
    for batch, context, window in ((64 // div, 4096, None), (64 // div, 8192 // min(div, 4), 1024),
                                   (1, 16384 // min(div, 4), None)):
        rows = [(1, context)] * batch
        query, _, _, k_cache, v_cache, meta = _paged_batch(rows, device, dtype)
        visible = min(context, window or context)
        add(
            "paged_decode_attention",
            f"b{batch} ctx{context}" + (f" win{window}" if window else ""),
            (query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, window, context),
            attention.paged_decode_attention,
            2 * batch * visible * NUM_KV_HEADS * HEAD_DIM * es,
        )
    for rows, window, label in (
        ([(2048 // div, 2048 // div)] * 4, None, "4 fresh prompts"),
        ([(512 // div, 4096 // div)] * 8, None, "8 chunks over a prefix"),
        ([(2048 // div, 4096 // div)] * 2, 512, "2 chunks, window 512"),
    ):
        query, key, value, k_cache, v_cache, meta = _paged_batch(rows, device, dtype)
        pairs = sum(_visible_pairs(q, s, window) for q, s in rows)
        add(
            "paged_attention",
            f"{label}: q{rows[0][0]} seq{rows[0][1]}",
            (query, key, value, k_cache, v_cache, meta, scale, window),
            attention.paged_attention,
            flops=4.0 * NUM_HEADS * HEAD_DIM * pairs,
        )
    return cases


def _max_error(a: object, b: object) -> float:
    if a is None or b is None:
        return 0.0
    if isinstance(a, tuple):
        return max(_max_error(x, y) for x, y in zip(a, b, strict=True))
    return float((a.float() - b.float()).abs().max())


# ---- main ----


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="8x smaller shapes and fewer repeats")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 elsewhere")
    parser.add_argument("--out", help="result JSON (default bench/results/kernels_<machine kind>.json, "
                                      "kernels_quick.json with --quick)")
    args = parser.parse_args()
    torch.manual_seed(0)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    with_triton = device.type == "cuda"
    if with_triton:
        os.environ.pop("TRITON_INTERPRET", None)
        device_name, backend = torch.cuda.get_device_name(device), "triton"
    else:
        device_name = f"{platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"
        backend = "native" if _native_cpu_kernels() is not None else None
        print("No CUDA device: the native C++ kernels against the torch references (Triton's CPU interpreter is "
              "not a benchmark).")
    min_seconds, max_reps = (0.05, 10) if args.quick else (0.3, 100)

    ceilings = measure_ceilings(device, dtype, args.quick)
    print(
        f"{device_name}, {str(dtype).removeprefix('torch.')}: copy {ceilings['copy_gb_s']:.0f} GB/s, "
        f"matmul {ceilings['matmul_tflop_s']:.4g} TFLOP/s"
    )
    results = []
    with torch.inference_mode():
        for case in build_cases(device, dtype, args.quick, with_triton):
            ref_ms = time_ms(case.reference, device, min_seconds, max_reps)
            tri_ms = time_ms(case.kernel, device, min_seconds, max_reps) if case.kernel else None
            error = _max_error(case.reference(), case.kernel()) if case.kernel else None
            best_ms = min(ref_ms, tri_ms) if tri_ms is not None else ref_ms
            if case.flops:
                achieved, unit = case.flops / best_ms / 1e9, "TFLOP/s"
                ceiling = ceilings["matmul_tflop_s"]
            else:
                achieved, unit = case.bytes / best_ms / 1e6, "GB/s"
                ceiling = ceilings["copy_gb_s"]
            results.append(
                {
                    "op": case.op,
                    "shape": case.shape,
                    "torch_ms": ref_ms,
                    "kernel_ms": tri_ms,
                    "speedup": ref_ms / tri_ms if tri_ms else None,
                    "achieved": achieved,
                    "unit": unit,
                    "ceiling_fraction": achieved / ceiling,
                    "max_abs_error": error,
                }
            )

    header = (
        f"{'op':<24}{'shape':<40}{'torch ms':>10}{(backend or 'kernel') + ' ms':>11}{'speedup':>9}{'achieved':>18}"
        f"{'% ceil':>8}"
    )
    print("\n" + header + f"{'max err':>10}")
    for r in results:
        tri = (
            f"{r['kernel_ms']:>11.3f}{r['speedup']:>8.2f}x"
            if r["kernel_ms"] is not None
            else f"{'-':>11}{'-':>9}"
        )
        err = f"{r['max_abs_error']:>10.2e}" if r["max_abs_error"] is not None else f"{'-':>10}"
        print(
            f"{r['op']:<24}{r['shape']:<40}{r['torch_ms']:>10.3f}{tri}"
            f"{r['achieved']:>10.4g} {r['unit']:<7}{100 * r['ceiling_fraction']:>7.0f}%{err}"
        )
    report = {
        "device": device_name,
        "dtype": str(dtype).removeprefix("torch."),
        "kernel_backend": backend,
        "torch": torch.__version__,
        "triton": _triton_version() if with_triton else None,
        "host": platform.node(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "ceilings": ceilings,
        "results": results,
    }
    print()
    write_json(report, args.out or default_out(RESULTS, "kernels", quick=args.quick))


def _triton_version() -> str:
    import triton

    return triton.__version__


if __name__ == "__main__":
    main()
