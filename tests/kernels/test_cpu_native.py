"""The native CPU kernels (kernels/cpu) against the torch reference ops and the dense attention reference."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import attrs
import pytest
import torch
import torch.nn.functional as F

from ksana.kernels import attention, norm, rotary
from ksana.kernels.backends import cpu_ops
from ksana.kernels.cpu import load_library
from ksana.kernels.cpu.build import LEVELS, WIDE_LANES_ENV, cpu_level, find_cxx_compiler
from ksana.kernels.cpu.ops import (
    AMD_PACKED_PREFETCH_MIN_ROWS,
    AMX_MIN_ROWS,
    AMX_PREFILL_QUERY_CHUNK,
    AVX512_BF16_MIN_ROWS,
    NATIVE_EMBEDDING_MAX_ROWS,
    NativeCPUOps,
    _cache_layout,
    _cpu_vendor,
    amx_bf16_available,
    bf16_onednn_min_rows,
    packed_prefetch_min_rows,
)
from ksana.kernels.cpu.packed import PackedWeight, dense_weight
from ksana.models import load_model
from ksana.worker.kv_cache import KVCache
from tests.kernels.test_attention import HEAD_DIM, ROWS, as_head_major, dense_reference, make_batch
from tests.model_factory import BlockPool, PagedSequence, build_step, make_checkpoint, random_prompts

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def library():
    """The compiled kernels' operators (``torch.ops.ksana``); the tests that need them skip where they cannot build
    (the engine then runs the torch reference ops, which ``test_no_compiler.py`` covers)."""
    if find_cxx_compiler() is None:
        pytest.skip("no C++ compiler: the native CPU kernels cannot build here")
    built = load_library()
    assert built is not None, "a C++ compiler is on the PATH, yet the kernels did not build (see the log)"
    return built


@pytest.fixture(scope="module")
def native(library) -> NativeCPUOps:
    return NativeCPUOps(library)


@pytest.fixture(scope="module")
def packing(native: NativeCPUOps) -> NativeCPUOps:
    """The native ops where this CPU packs weights (AVX2 or AVX-512): the packed linear and the fused decode step."""
    if not native.has_linear:
        pytest.skip("no packed linear or fused decode step on this CPU: they need AVX2 or AVX-512")
    return native


def test_cpu_dispatch_picks_the_native_kernels(library) -> None:
    ops = cpu_ops()
    assert ops.name == "cpu-native"
    # the native prefill wrapper, which keeps SDPA where its kernel does not apply
    assert ops.paged_prefill_attention.__func__ is NativeCPUOps.paged_prefill_attention


# The instruction sets below this CPU's (at least the portable C): what other CPUs run, built and checked here.
LOWER_LEVELS = LEVELS[: max(1, LEVELS.index(cpu_level()))]


@pytest.mark.parametrize("level", LOWER_LEVELS)
def test_lower_instruction_set_builds_match_the_reference(library, level: str) -> None:
    """Each lower level's build: decode attention (both task layouts and split tasks, with and without a window),
    from AVX2 on the packed linear kernel with float32 widening of bfloat16 (every row the bits it gets alone), and
    the C++ norm and rotary (their portable lanes below AVX2)."""
    code = f"""
import sys
sys.path.append({str(Path(__file__).resolve().parents[2])!r})  # the tests package, after site-packages
import torch
import torch.nn.functional as F
from ksana.kernels import attention
from ksana.kernels.cpu import load_library
from ksana.kernels.cpu.build import build_level
from ksana.kernels.cpu.ops import NativeCPUOps
from ksana.kernels.cpu.packed import PackedWeight
from tests.kernels.test_attention import make_batch
assert build_level() == {level!r}
native = NativeCPUOps(load_library())
assert native.has_linear == ({level!r} != "portable")
torch.set_num_threads(2)
# 5 sequences: one task per sequence on 2 threads; 2: one task per KV head; one long one (32 heads): split tasks.
for rows, heads in (([(1, 1), (1, 17), (1, 90), (1, 33), (1, 5)], (6, 2)), ([(1, 17), (1, 90)], (6, 2)),
                    ([(1, 1300)], (32, 4))):
    (k_cache, v_cache), (q, _, _), meta, _, _ = make_batch(rows, *heads, 16)
    for window in (None, 20):
        args = (q, k_cache, v_cache, meta.block_tables, meta.seq_lens, 0.25, window)
        torch.testing.assert_close(native.paged_decode_attention(*args), attention.paged_decode_attention(*args))
for dtype, rtol in ((torch.float32, 1e-5), (torch.bfloat16, 2**-8)):
    x, w, b = torch.randn(13, 100).to(dtype), (torch.randn(61, 100) / 10).to(dtype), torch.randn(61).to(dtype)
    expected = F.linear(x.float(), w.float(), b.float())
    packed = native.pack_weight(w)
    assert isinstance(packed, PackedWeight) == ({level!r} != "portable")
    torch.testing.assert_close(native.linear(x, packed, b).float(), expected, rtol=rtol, atol=1e-5)
    if {level!r} != "portable":  # 13 and 20 rows (bfloat16 blocks widened once for their chunks): each row's bits alone
        for rows in (x, torch.cat([x, x[:7]])):
            together = native.linear(rows, packed, b)
            assert all(torch.equal(together[i], native.linear(rows[i:i + 1], packed, b)[0]) for i in range(len(rows)))
    if {level!r} == "portable":  # no packed weights: the model keeps the logits path and torch's matmuls
        assert native.lm_head_greedy(x, packed, 61, min_rows=1) is None
        assert NativeCPUOps(load_library(), bf16_blas_min_rows=4).bf16_blas_min_rows is None
logits = torch.randn(3, 1003) * 3
ids, logprobs = native.greedy_logprobs(logits)
assert ids == logits.argmax(dim=-1).tolist()
raw = torch.log_softmax(logits, dim=-1)
torch.testing.assert_close(torch.tensor(logprobs), raw[torch.arange(3), ids], rtol=0, atol=1e-5)
# the C++ kernels over vec.h's lanes: elementwise bits as torch's, the norm to float32 rounding
from ksana.kernels import norm, rotary
for dtype in (torch.float32, torch.bfloat16):
    x, residual, w = (torch.randn(5, 45) * 3).to(dtype), torch.randn(5, 45).to(dtype), torch.randn(45).to(dtype)
    torch.testing.assert_close(native.rms_norm(x, w, 1e-5), norm.rms_norm(x, w, 1e-5))
    normed, new_residual = native.fused_add_rms_norm(x, residual, w, 1e-5)
    assert torch.equal(new_residual, norm.fused_add_rms_norm(x, residual, w, 1e-5)[1])
    q, cos, sin = torch.randn(3, 4, 40).to(dtype), torch.randn(3, 40).to(dtype), torch.randn(3, 40).to(dtype)
    assert torch.equal(native.apply_rotary(q, cos, sin), rotary.apply_rotary(q, cos, sin))
"""
    env = {**os.environ, "KSANA_CPU_KERNELS": level}  # the suite's kernel cache: one registration for every level
    subprocess.run([sys.executable, "-c", code], env=env, check=True)


def test_the_build_runs_the_lanes_its_cpu_and_settings_ask_for(library) -> None:
    wide = cpu_level() == "avx512" or os.environ.get(WIDE_LANES_ENV) == "1"
    assert library.vector_lanes() == (16 if wide else 8)


# The tests of the C++ kernels that take 16 lanes on AVX-512 (and this one's own check of the lanes): SiLU, the
# attention, and the packed linear's wide schedule (its tiles, fused greedy sampling and the fused decode step).
WIDE_LANE_TESTS = ("silu or head_sizes or gqa_group_sizes or split_their_positions or whole_in_their_tasks or "
                   "in_order or prefill_attention_matches or prefill_reads_no_block or lanes_its_cpu or "
                   "packed_linear or lm_head_greedy or fused_decode_layers")


def test_the_sixteen_lane_kernels_pass_their_tests_on_pairs_of_eight_lanes(library) -> None:
    """The C++ kernels' 16-lane (AVX-512) code, built with KSANA_CPU_WIDE_LANES=1 so that vec.h's F32x16 is two
    F32x8 here, passes this module's tests of SiLU, decode and prefill attention, and the packed linear's wide
    schedule: the source an AVX-512 CPU runs, but for the thin __m512 wrapper (compiled in
    test_cpu_avx512_build.py)."""
    if os.environ.get(WIDE_LANES_ENV) == "1" or cpu_level() == "avx512":
        pytest.skip("this run's build has the 16 lanes already")
    env = {**os.environ, WIDE_LANES_ENV: "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:warnings",
                           __file__, "-k", WIDE_LANE_TESTS], env=env, capture_output=True, text=True, check=False,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " skipped" not in done.stdout, done.stdout[-2000:]


def test_env_switch_falls_back_to_the_torch_reference() -> None:
    code = "from ksana.kernels import get_ops; from ksana.kernels.dispatch import TORCH_OPS; assert get_ops('cpu') is TORCH_OPS"
    env = {**os.environ, "KSANA_CPU_KERNELS": "torch"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("dim", [576, 45])  # 45: the vector loops' 32 and 8 values a step, then the scalar tail
def test_rms_norm_and_fused_add(native: NativeCPUOps, dtype: torch.dtype, rows: int, dim: int) -> None:
    torch.manual_seed(rows)
    weight = torch.randn(dim).to(dtype)
    x = (torch.randn(rows, dim) * 3).to(dtype)
    residual = torch.randn(rows, dim).to(dtype)
    torch.testing.assert_close(native.rms_norm(x, weight, 1e-5), norm.rms_norm(x, weight, 1e-5))
    normed, new_residual = native.fused_add_rms_norm(x, residual, weight, 1e-5)
    ref_normed, ref_residual = norm.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(new_residual, ref_residual)  # the add rounds exactly as torch does
    torch.testing.assert_close(normed, ref_normed)
    assert normed.dtype == dtype and new_residual.dtype == dtype


def test_rms_norm_reads_strided_rows(native: NativeCPUOps) -> None:
    wide = torch.randn(5, 100)
    weight = torch.randn(48)
    x = wide[:, 10:58]
    torch.testing.assert_close(native.rms_norm(x, weight, 1e-6), norm.rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_on_the_fused_qkv_view_equals_the_reference(native: NativeCPUOps, dtype: torch.dtype) -> None:
    num_tokens, num_heads, num_kv_heads, head_dim = 9, 6, 2, 64
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    cos, sin = rotary.rotary_cos_sin(torch.tensor([0, 3, 1, 700, 17, 2, 2, 9, 64]), inv_freq, 1.0, dtype)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    qk = qkv[:, : (num_heads + num_kv_heads) * head_dim].view(num_tokens, num_heads + num_kv_heads, head_dim)
    assert torch.equal(native.apply_rotary(qk, cos, sin), rotary.apply_rotary(qk, cos, sin))


def test_rotary_gptj_falls_back(native: NativeCPUOps) -> None:
    x = torch.randn(4, 3, 8)
    cos, sin = torch.randn(4, 8), torch.randn(4, 8)
    assert torch.equal(native.apply_rotary(x, cos, sin, is_neox=False), rotary.apply_rotary(x, cos, sin, False))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(native: NativeCPUOps, dtype: torch.dtype) -> None:
    gate, up = (torch.randn(33, 1536) * 4).to(dtype), torch.randn(33, 1536).to(dtype)
    torch.testing.assert_close(native.silu_and_mul(torch.cat([gate, up], dim=-1)), F.silu(gate) * up)


@pytest.mark.parametrize("head_major", [False, True])
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16])
def test_store_kv_writes_exactly_the_given_slots(native: NativeCPUOps, dtype: torch.dtype, head_major: bool) -> None:
    k_cache, v_cache = torch.zeros(6, 4, 3, 8, dtype=dtype), torch.zeros(6, 4, 3, 8, dtype=dtype)
    if head_major:
        k_cache, v_cache = as_head_major(k_cache), as_head_major(v_cache)
    qkv = torch.randn(5, 9, 8).to(dtype)  # key and value are strided views, as in the decoder
    key, value = qkv[:, 3:6], qkv[:, 6:9]
    slots = torch.tensor([23, 0, 5, 6, 17])
    assert _cache_layout(k_cache, v_cache) is not None  # the C path takes both layouts
    native.store_kv_cache(key, value, k_cache, v_cache, slots)
    ref_k, ref_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    attention.store_kv_cache(key, value, ref_k, ref_v, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


@pytest.mark.parametrize("head_major", [False, True])
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("window", [None, 1, 6, 37])
@pytest.mark.parametrize("heads", [(6, 2), (5, 5), (12, 3), (7, 1)])
def test_native_paged_attention_matches_dense(heads: tuple[int, int], window: int | None, block_size: int,
                                              head_major: bool) -> None:
    num_heads, num_kv_heads = heads
    (k_cache, v_cache), (q, k, v), meta, full_k, full_v = make_batch(ROWS, num_heads, num_kv_heads, block_size,
                                                                     head_major=head_major)
    out = cpu_ops().paged_attention(q, k, v, k_cache, v_cache, meta, HEAD_DIM**-0.5, window)
    start = 0
    for i, (q_len, seq_len) in enumerate(ROWS):
        ref = dense_reference(q[start : start + q_len], full_k[i], full_v[i], seq_len, window)
        torch.testing.assert_close(out[start : start + q_len].double(), ref, rtol=1e-5, atol=1e-5, msg=f"row {i}")
        start += q_len


def _store_whole_context(k_cache, v_cache, table, keys, values) -> None:
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    slots = torch.tensor([int(table[p // block_size]) * block_size + p % block_size for p in range(len(keys))])
    k_cache.view(-1, num_kv_heads, HEAD_DIM)[slots] = keys
    v_cache.view(-1, num_kv_heads, HEAD_DIM)[slots] = values


@pytest.mark.parametrize("window", [None, 20])
def test_bf16_decode_attention_is_as_accurate_as_the_reference(native: NativeCPUOps, window: int | None) -> None:
    """bfloat16 in, float32 arithmetic inside, probabilities rounded to bf16 before they weight V (as SDPA does):
    against a float64 dense result on the same bf16 inputs the error is bf16-sized and no larger than SDPA's."""
    rows = [(1, 1), (1, 17), (1, 90), (1, 33)]
    (k_cache, v_cache), (q, _, _), meta, full_k, full_v = make_batch(rows, 9, 3, 16)
    q, k_cache, v_cache = q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()
    for i in range(len(rows)):  # the decode token's own K/V too, as after the store
        _store_whole_context(k_cache, v_cache, meta.block_tables[i], full_k[i].bfloat16(), full_v[i].bfloat16())
    args = (q, k_cache, v_cache, meta.block_tables, meta.seq_lens, HEAD_DIM**-0.5, window)
    out = native.paged_decode_attention(*args)
    assert out.dtype == torch.bfloat16
    reference = attention.paged_decode_attention(*args)
    exact = torch.cat([dense_reference(q[i : i + 1], full_k[i].bfloat16(), full_v[i].bfloat16(), seq_len, window)
                       for i, (_, seq_len) in enumerate(rows)])
    native_error = (out.double() - exact).abs()
    torch.testing.assert_close(out, reference, rtol=1.6e-2, atol=2e-3)
    assert native_error.max() <= (reference.double() - exact).abs().max()


def assert_decode_close(out: torch.Tensor, reference: torch.Tensor) -> None:
    """Native decode attention against the torch reference: float32 to rounding, bfloat16 to its precision."""
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out, reference, rtol=1.6e-2, atol=2e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 48, 64, 80, 8])
@pytest.mark.parametrize("batch", [5, 1])
def test_decode_attention_head_sizes(native: NativeCPUOps, dtype: torch.dtype, head_dim: int, batch: int) -> None:
    """The 16-lane task (head sizes a multiple of 16: whole and partial 64-wide chunks of P @ V) and the 8-lane
    one, per sequence (5 sequences) and per KV head (1), against the torch reference on the same cache."""
    gen = torch.Generator().manual_seed(head_dim * batch)
    num_blocks, block_size, num_heads, num_kv_heads = 70, 16, 9, 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(batch, num_heads, head_dim, generator=gen).to(dtype)
    seq_lens = torch.tensor([131, 1, 16, 47, 200][:batch])
    block_tables = torch.randperm(num_blocks, generator=gen)[: batch * 13].view(batch, 13)
    for window in (None, 37):
        args = (q, k_cache, v_cache, block_tables, seq_lens, head_dim**-0.5, window)
        out, reference = native.paged_decode_attention(*args), attention.paged_decode_attention(*args)
        assert_decode_close(out, reference)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 8])
def test_few_long_sequences_split_their_positions_across_the_threads(native: NativeCPUOps, dtype: torch.dtype,
                                                                     head_dim: int) -> None:
    """Fewer sequences than twice the threads: each KV head's positions are split into chunks (flash-decoding,
    on 2 threads) whose parts are combined at the end; the 16-lane task (head size 64) and the 8-lane one (8).
    One sequence of 1500 positions (6 chunks); three where one has a single position, so some of its chunks are
    empty and must weigh nothing; and the same under a window."""
    gen = torch.Generator().manual_seed(head_dim)
    num_blocks, block_size, num_heads, num_kv_heads = 300, 16, 9, 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for seq_lens in ([1500], [1500, 1, 300]):
            batch = len(seq_lens)
            q = (torch.randn(batch, num_heads, head_dim, generator=gen) * 2).to(dtype)
            block_tables = torch.randperm(num_blocks, generator=gen)[: batch * 94].view(batch, 94)
            for window in (None, 600):
                args = (q, k_cache, v_cache, block_tables, torch.tensor(seq_lens), head_dim**-0.5, window)
                out, reference = native.paged_decode_attention(*args), attention.paged_decode_attention(*args)
                assert_decode_close(out, reference)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", DTYPES)
def test_long_sequences_whole_in_their_tasks_give_the_reference(native: NativeCPUOps, dtype: torch.dtype) -> None:
    """Four sequences on 2 threads, each in one task: at head size 64 tasks of 512 positions or more go in longer
    tiles (decode_tile_avx2), with a last partial tile (513, 1025, and 700 under the window) and short ones."""
    gen = torch.Generator().manual_seed(512)
    num_blocks, block_size, num_heads, num_kv_heads, head_dim = 300, 16, 9, 3, 64
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seq_lens = torch.tensor([1025, 513, 512, 70])
        q = (torch.randn(4, num_heads, head_dim, generator=gen) * 2).to(dtype)
        block_tables = torch.randperm(num_blocks, generator=gen)[: 4 * 65].view(4, 65)
        for window in (None, 700):
            args = (q, k_cache, v_cache, block_tables, seq_lens, head_dim**-0.5, window)
            out, reference = native.paged_decode_attention(*args), attention.paged_decode_attention(*args)
            assert_decode_close(out, reference)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (4, 2), (8, 2), (10, 2), (12, 2), (14, 2), (8, 1)])
@pytest.mark.parametrize("head_dim", [64, 48])
def test_decode_attention_gqa_group_sizes(native: NativeCPUOps, dtype: torch.dtype, num_heads: int,
                                          num_kv_heads: int, head_dim: int) -> None:
    """The 16-lane task serves up to four query heads of a KV head per pass over its rows, the 8-lane one up to
    three: groups of 1, 2, 4, 5, 6, 7 and 8 query heads (one pass, or four, three or both plus the rest), with a
    sequence per task and a KV head per task."""
    gen = torch.Generator().manual_seed(num_heads * 100 + num_kv_heads * 10 + head_dim)
    num_blocks, block_size = 40, 16
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    for batch, seq_lens in ((5, [70, 1, 16, 33, 9]), (1, [131])):
        q = torch.randn(batch, num_heads, head_dim, generator=gen).to(dtype)
        width = 9 if batch == 1 else 8  # blocks per sequence, enough for its longest
        block_tables = torch.randperm(num_blocks, generator=gen)[: batch * width].view(batch, width)
        args = (q, k_cache, v_cache, block_tables, torch.tensor(seq_lens), head_dim**-0.5, None)
        out, reference = native.paged_decode_attention(*args), attention.paged_decode_attention(*args)
        assert_decode_close(out, reference)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (12, 2, 80), (6, 2, 16)])
def test_decode_over_blocks_in_order_gives_the_bits_of_scattered_ones(native: NativeCPUOps, dtype: torch.dtype,
                                                                       num_heads: int, num_kv_heads: int,
                                                                       head_dim: int) -> None:
    """Blocks that follow one another in memory are left to the hardware prefetcher and their keys read row by row
    (the AVX-512 task's qk_rows), blocks at random through the other order of reads: the same sums in the same
    order, so the same bits. Sequence 0's blocks are in order but one, so a task also switches between the two."""
    gen = torch.Generator().manual_seed(num_heads + head_dim)
    batch, width, block_size = 8, 6, 16
    num_blocks = batch * width + 1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = as_head_major(torch.randn(shape, generator=gen).to(dtype))
    v_cache = as_head_major(torch.randn(shape, generator=gen).to(dtype))
    in_order = torch.arange(batch * width).view(batch, width)
    in_order[0, 3] = num_blocks - 1  # a jump in the middle of a sequence
    seq_lens = torch.tensor([95, 96, 81, 66, 90, 17, 50, 93])  # some end inside a block, some not on four
    q = torch.randn(batch, num_heads, head_dim, generator=gen).to(dtype)
    moved_to = torch.randperm(num_blocks, generator=gen)  # block b of the in-order cache is block moved_to[b] here
    k_scattered, v_scattered = torch.empty_like(k_cache), torch.empty_like(v_cache)
    k_scattered[moved_to], v_scattered[moved_to] = k_cache, v_cache
    scale = head_dim**-0.5
    out = native.paged_decode_attention(q, k_cache, v_cache, in_order, seq_lens, scale, None)
    scattered = native.paged_decode_attention(q, k_scattered, v_scattered, moved_to[in_order], seq_lens, scale, None)
    assert torch.equal(out, scattered)
    assert_decode_close(out, attention.paged_decode_attention(q, k_cache, v_cache, in_order, seq_lens, scale, None))


def test_decode_reads_no_block_outside_the_window(native: NativeCPUOps) -> None:
    """Blocks before the window may hold garbage (reused SWA blocks): NaNs there must not reach the output."""
    rows = [(1, 61), (1, 23)]
    (k_cache, v_cache), (q, _, _), meta, full_k, full_v = make_batch(rows, 6, 3, 4, seed=3)
    for i, (_, seq_len) in enumerate(rows):
        _store_whole_context(k_cache, v_cache, meta.block_tables[i], full_k[i], full_v[i])
        for b in meta.block_tables[i, : (seq_len - 8) // 4].tolist():
            k_cache[b] = v_cache[b] = float("nan")
    out = native.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, HEAD_DIM**-0.5, 8)
    assert torch.isfinite(out).all()
    for i, (_, seq_len) in enumerate(rows):
        ref = dense_reference(q[i : i + 1], full_k[i], full_v[i], seq_len, 8)
        torch.testing.assert_close(out[i : i + 1].double(), ref, rtol=1e-5, atol=1e-5)


def _prefill_case(head_dim: int, num_heads: int, num_kv_heads: int, q_len: int, seq_len: int, seed: int,
                  head_major: bool = True, dtype: torch.dtype = torch.float32):
    """One sequence's whole context stored in a shuffled block table, its last ``q_len`` queries."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks, block_size = -(-seq_len // 16) + 3, 16
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    if head_major:
        k_cache, v_cache = as_head_major(k_cache), as_head_major(v_cache)
    table = torch.randperm(num_blocks, generator=gen)[: -(-seq_len // block_size)]
    keys, values = (torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    slots = table[torch.arange(seq_len) // block_size] * block_size + torch.arange(seq_len) % block_size
    for cache, rows in ((k_cache, keys), (v_cache, values)):
        cache[slots // block_size, slots % block_size] = rows
    q = torch.randn(q_len, num_heads, head_dim, generator=gen).to(dtype)
    return q, keys, values, k_cache, v_cache, table


# (q_len, seq_len): one position, fresh prompts inside one and across several query blocks of 16 and key tiles
# of 16, a chunk over a cached prefix that starts mid-tile, a long one over a long prefix.
NATIVE_PREFILLS = [(1, 1), (5, 5), (16, 16), (17, 17), (50, 50), (23, 61), (100, 300)]


@pytest.mark.parametrize("window", [None, 1, 7, 16, 45])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"),
                         [(9, 3, 64), (9, 3, 40), (4, 4, 8), (8, 2, 16), (7, 1, 24)])
def test_native_prefill_attention_matches_dense(native: NativeCPUOps, num_heads: int, num_kv_heads: int,
                                                head_dim: int, window: int | None) -> None:
    """The float32 prefill kernel (query blocks of 16 positions against key tiles of 16; 32-wide and 8-wide
    value chunks; query groups of 3, of 1, and of 4 and 7 with heads left over) against a float64 dense result."""
    assert native.has_prefill_attention == native.has_linear  # an AVX2 build has it, a portable not
    for i, (q_len, seq_len) in enumerate(NATIVE_PREFILLS):
        q, keys, values, k_cache, v_cache, table = _prefill_case(head_dim, num_heads, num_kv_heads, q_len, seq_len,
                                                                 seed=i, head_major=i % 2 == 0)
        out = native.paged_prefill_attention(q, keys[-q_len:], values[-q_len:], k_cache, v_cache, table, seq_len,
                                             head_dim**-0.5, window)
        ref = dense_reference(q, keys, values, seq_len, window)
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5, msg=f"{q_len} of {seq_len}")


def test_native_prefill_reads_no_block_outside_the_window(native: NativeCPUOps) -> None:
    """As decode: blocks before the window may hold garbage (reused SWA blocks); NaNs there never reach the output."""
    q, keys, values, k_cache, v_cache, table = _prefill_case(64, 9, 3, 20, 120, seed=5)
    for block in table[: (120 - 20 - 8) // 16].tolist():
        k_cache[block] = v_cache[block] = float("nan")
    out = native.paged_prefill_attention(q, keys[-20:], values[-20:], k_cache, v_cache, table, 120, 0.125, 8)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), dense_reference(q, keys, values, 120, 8), rtol=1e-5, atol=1e-5)


def test_native_prefill_keeps_sdpa_for_bfloat16(native: NativeCPUOps) -> None:
    q, keys, values, k_cache, v_cache, table = _prefill_case(64, 9, 3, 30, 40, seed=6, dtype=torch.bfloat16)
    args = (q, keys[-30:], values[-30:], k_cache, v_cache, table, 40, 0.125, None)
    assert torch.equal(native.paged_prefill_attention(*args), attention.paged_prefill_attention(*args))


@pytest.mark.parametrize(("q_len", "seq_len"), [(300, 300), (100, 400)])
def test_bfloat16_prefill_takes_its_own_query_chunks(library, monkeypatch, q_len: int,
                                                     seq_len: int) -> None:
    """With ``bf16_prefill_query_chunk`` (AMX CPUs) a bfloat16 prefill is the reference's in chunks of that many
    queries; float32 keeps the native kernel."""
    chunked = NativeCPUOps(library, bf16_prefill_query_chunk=256)
    q, keys, values, k_cache, v_cache, table = _prefill_case(64, 9, 3, q_len, seq_len, seed=8, dtype=torch.bfloat16)
    args = (q, keys[-q_len:], values[-q_len:], k_cache, v_cache, table, seq_len, 0.125, None)
    reference, chunks = attention.paged_prefill_attention, []

    def recording(*call_args, query_chunk=None):
        chunks.append(query_chunk)
        return reference(*call_args, query_chunk=query_chunk)

    monkeypatch.setattr(attention, "paged_prefill_attention", recording)
    out = chunked.paged_prefill_attention(*args)
    monkeypatch.undo()
    assert chunks == [256]
    assert torch.equal(out, reference(*args, query_chunk=256))
    torch.testing.assert_close(out, reference(*args), rtol=2**-7, atol=1e-3)  # a bfloat16 ulp near zero
    q32, k32, v32, kc32, vc32, table32 = _prefill_case(64, 9, 3, q_len, seq_len, seed=8)
    args32 = (q32, k32[-q_len:], v32[-q_len:], kc32, vc32, table32, seq_len, 0.125, None)
    unchunked = NativeCPUOps(library).paged_prefill_attention(*args32)
    assert torch.equal(chunked.paged_prefill_attention(*args32), unchunked)


def test_cpu_dispatch_chunks_bfloat16_prefills_for_amx_exactly_on_amx(library) -> None:
    prefill = cpu_ops().paged_prefill_attention
    assert prefill.__self__.bf16_prefill_query_chunk == (AMX_PREFILL_QUERY_CHUNK if amx_bf16_available() else None)


def test_unsupported_dtype_uses_the_reference(native: NativeCPUOps) -> None:
    x, weight = torch.randn(3, 16).half(), torch.randn(16).half()
    assert torch.equal(native.rms_norm(x, weight, 1e-6), norm.rms_norm(x, weight, 1e-6))


# ---- the packed-weight linear and the fused decode layers (AVX2 and AVX-512 builds) ----------------------------
def test_packed_linear_is_there_exactly_on_avx2_and_avx512(native: NativeCPUOps) -> None:
    assert native.has_linear == (torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"))
    ops = cpu_ops()
    assert (ops.qkv_proj is not F.linear) == native.has_linear
    assert (ops.decode_layers is not None) == native.has_linear
    assert (ops.pack_weights is not None) == native.has_linear


# Rows: every decode tile (1-16, with 1, 2 or 4 panels a tile); above 16, the AVX2 build's 3-row chunks across the
# packed input's 8-row tiles (whole and partial last tiles; 25 and 64 end in 2 + 2 rows, 25 inside a partial tile).
LINEAR_ROWS = [*range(1, 18), 24, 25, 29, 64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("out_features", "in_features"), [(7, 37), (64, 576), (61, 48), (130, 100), (49, 1)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_torch(native: NativeCPUOps, dtype: torch.dtype, out_features: int,
                                     in_features: int, with_bias: bool) -> None:
    """Every row count a tile shape handles, outputs not a multiple of the 16-column panel (and of the 2-4 panel
    groups), strided input rows. (Without AVX2 the weight stays as it is and BLAS runs: the same results.)"""
    torch.manual_seed(out_features * in_features)
    weight = (torch.randn(out_features, in_features) / in_features**0.5).to(dtype)
    bias = torch.randn(out_features).to(dtype) if with_bias else None
    packed = native.pack_weight(weight)
    assert isinstance(packed, PackedWeight) == native.has_linear and packed.shape == (out_features, in_features)
    assert torch.equal(dense_weight(packed), weight)
    for rows in LINEAR_ROWS:
        wide = torch.randn(rows, in_features + 5).to(dtype)
        x = wide[:, 2 : 2 + in_features]  # rows in_features + 5 apart
        out = native.linear(x, packed, bias)
        assert out.shape == (rows, out_features) and out.dtype == dtype
        expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        if dtype == torch.float32:
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        else:  # float32 accumulation, one rounding to bfloat16 at the end
            torch.testing.assert_close(out.float(), expected, rtol=2**-8, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("out_features", "in_features"), [(64, 576), (61, 37), (130, 100)])
def test_packed_linear_gives_every_row_the_bits_it_gets_alone(packing: NativeCPUOps, dtype: torch.dtype,
                                                                out_features: int, in_features: int) -> None:
    """Every tile sums a row's products in the same order (one FMA per k from zero, then the bias), so a batched
    decode step gives each sequence what it would get alone: the 9-16-row split tile's two halves and k blocks
    (in_features 37 and 100 end in partial blocks) against the one-row tile, and the gemm tiles above 16 rows."""
    torch.manual_seed(out_features + in_features)
    weight = (torch.randn(out_features, in_features) / in_features**0.5).to(dtype)
    bias = torch.randn(out_features).to(dtype)
    packed = packing.pack_weight(weight)
    x = torch.randn(24, in_features).to(dtype)
    alone = torch.cat([packing.linear(x[i : i + 1], packed, bias) for i in range(24)])
    for rows in [*range(2, 18), 24]:
        assert torch.equal(packing.linear(x[:rows], packed, bias), alone[:rows]), rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("vocab", "out_features", "in_features"), [(1003, 1003, 64), (1000, 1040, 37), (9, 9, 16)])
def test_lm_head_greedy_gives_what_greedy_logprobs_gives_on_the_logits(packing: NativeCPUOps, dtype: torch.dtype,
                                                                       vocab: int, out_features: int,
                                                                       in_features: int) -> None:
    """Every decode-tile row count (1-4 panels a group), gemm tiles above 16 rows (whole and partial 16-row
    slices and 8-row tiles), a vocabulary with a tail and one short of the weight's rows (padding columns ignored),
    strided rows, a tie (the first column wins), and rows whose logits hold a NaN, are all -inf, or hold +inf: the
    same token as ``greedy_logprobs`` on ``linear``'s logits (bfloat16 logits rounded as they are stored), the
    same log-probability to float32 rounding."""
    native = packing
    torch.manual_seed(vocab + in_features)
    weight = (torch.randn(out_features, in_features) / in_features**0.5).to(dtype)
    weight[vocab // 2 + 1] = weight[vocab // 2]  # two equal logits in every row
    weight[vocab // 2] *= 4  # ... made the maximum in most rows by scaling them up together
    weight[vocab // 2 + 1] = weight[vocab // 2]
    packed = native.pack_weight(weight)
    tied_rows = 0
    for rows in [*range(1, 17), 17, 24, 32, 37]:
        wide = torch.randn(rows, in_features + 3).to(dtype)
        x = wide[:, 1 : 1 + in_features]
        for first in range(0, rows - 3, 16):  # in every 16-row slice that has room
            x[first + 1, 0] = float("nan")  # every logit NaN: the first column, logprob NaN
            x[first + 2] = 0.0
            x[first + 3] = float("inf")  # logits of both signs of infinity (NaN where a weight is 0): as they say
        ids, logprobs = native.lm_head_greedy(x, packed, vocab, min_rows=1)
        logits = native.linear(x, packed).float()[:, :vocab].contiguous()
        expected_ids, expected_logprobs = native.greedy_logprobs(logits)
        assert ids == expected_ids
        assert [math.isnan(v) for v in logprobs] == [math.isnan(v) for v in expected_logprobs]
        finite = [i for i, v in enumerate(expected_logprobs) if not math.isnan(v)]
        assert [logprobs[i] for i in finite] == pytest.approx([expected_logprobs[i] for i in finite], abs=1e-5)
        tied_rows += ids.count(vocab // 2)
    assert tied_rows > 0  # the tie was the maximum somewhere
    assert native.lm_head_greedy(torch.randn(7, in_features).to(dtype), packed, vocab) is None  # the logits path
    assert native.lm_head_greedy(torch.randn(8, in_features).to(dtype), packed, vocab) is not None


def test_packed_linear_edges(native: NativeCPUOps) -> None:
    """Batched (3-d) inputs, zero rows, a bfloat16 NaN that stays NaN in its row only, an embedding lookup from
    the panels."""
    weight = torch.randn(40, 24)
    packed = native.pack_weight(weight)
    x = torch.randn(2, 3, 24)
    torch.testing.assert_close(native.linear(x, packed), F.linear(x, weight))
    assert native.linear(torch.empty(0, 24), packed).shape == (0, 40)
    ids = torch.tensor([0, 39, 16, 15, 17, 39])
    assert torch.equal(native.embedding(ids, packed), weight[ids])
    x16 = torch.randn(3, 24).bfloat16()
    x16[1, 5] = float("nan")
    out = native.linear(x16, native.pack_weight(weight.bfloat16()))
    assert out[1].isnan().all() and not out[[0, 2]].isnan().any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_from_packed_panels_natively_gives_the_rows(packing: NativeCPUOps, dtype: torch.dtype) -> None:
    """A decode batch's ids (the native gather), a prefill's (torch's indexing), and an id past the table, which
    leaves the native gather to the indexing."""
    native = packing
    weight = torch.randn(50, 72).to(dtype)  # 4 panels, the last one part padding
    packed = native.pack_weight(weight)
    ids = torch.tensor([0, 49, 16, 15, 17, 33, 49, 1])
    assert torch.equal(native.embedding(ids, packed), weight[ids])
    many = torch.randint(0, 50, (NATIVE_EMBEDDING_MAX_ROWS + 3,))
    assert torch.equal(native.embedding(many, packed), weight[many])
    past = torch.tensor([3, 50])  # row 50 is panel padding: the indexing's zeros, as before the native path
    assert torch.equal(native.embedding(past, packed), packed.rows(past))


@pytest.mark.parametrize("dtype", DTYPES)
def test_unpack_weight_gives_the_weight_transposed(packing: NativeCPUOps, dtype: torch.dtype) -> None:
    """Whole 64-row blocks and a partial one, a last panel with padding columns (zero)."""
    weight = torch.randn(61, 150).to(dtype)
    packed = packing.pack_weight(weight)
    unpacked = torch.full((150, 64), float("nan"), dtype=dtype)
    packing.library.unpack_weight(packed.packed, unpacked)
    assert torch.equal(unpacked[:, :61], weight.T) and not unpacked[:, 61:].any()


@pytest.mark.parametrize("with_bias", [False, True])
def test_bfloat16_projections_of_many_rows_go_to_torch_matmul(packing: NativeCPUOps, library,
                                                              with_bias: bool) -> None:
    """From ``bf16_blas_min_rows`` rows (strided ones, and 3-d input) the matmul runs in torch from the unpacked
    panels, to bfloat16 rounding of the float32 result as the native kernel; fewer rows stay native. float32
    never leaves the native kernel."""
    blas = NativeCPUOps(library, bf16_blas_min_rows=4)
    torch.manual_seed(4)
    weight = (torch.randn(61, 48) / 48**0.5).bfloat16()
    bias = torch.randn(61).bfloat16() if with_bias else None
    packed = blas.pack_weight(weight)
    expected_of = lambda x: F.linear(x.float(), weight.float(), None if bias is None else bias.float())  # noqa: E731
    x = torch.randn(3, 50).bfloat16()[:, 1:49]
    torch.testing.assert_close(blas.linear(x, packed, bias).float(), expected_of(x), rtol=2**-8, atol=1e-5)
    assert getattr(blas._scratch, "buffer", None) is None  # 3 rows: the native kernel
    for x in (torch.randn(40, 50).bfloat16()[:, 1:49], torch.randn(2, 5, 48).bfloat16()):
        out = blas.linear(x, packed, bias)
        assert out.shape == (*x.shape[:-1], 61) and out.dtype == torch.bfloat16 and out.is_contiguous()
        torch.testing.assert_close(out.float(), expected_of(x), rtol=2**-8, atol=1e-5)
    assert blas._scratch.buffer.numel() == 64 * 48  # the unpacked panels, kept for the next call
    blas.linear(torch.randn(40, 48), blas.pack_weight(weight.float()))
    assert blas._scratch.buffer.dtype == torch.bfloat16


def test_cpu_dispatch_sends_many_bfloat16_rows_to_onednn_from_this_cpus_threshold(packing: NativeCPUOps) -> None:
    projection = cpu_ops().qkv_proj
    assert projection.__self__.bf16_blas_min_rows == bf16_onednn_min_rows()


@pytest.mark.parametrize(("amx", "avx512_bf16", "vendor", "expected"), [
    (True, True, "GenuineIntel", AMX_MIN_ROWS),
    (False, True, "AuthenticAMD", AVX512_BF16_MIN_ROWS),
    (False, True, "GenuineIntel", None),  # Intel AVX-512 without AMX: the native kernel is the faster
    (False, False, "AuthenticAMD", None),  # AVX2 only (Zen 2, Zen 3)
])
def test_onednn_bfloat16_threshold_follows_the_cpu(monkeypatch: pytest.MonkeyPatch, amx: bool, avx512_bf16: bool,
                                                   vendor: str, expected: int | None) -> None:
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    monkeypatch.setattr("ksana.kernels.cpu.ops._cpu_vendor", lambda: vendor)
    assert bf16_onednn_min_rows() == (expected if torch.backends.mkldnn.is_available() else None)


@pytest.mark.parametrize(("vendor", "expected"), [("AuthenticAMD", AMD_PACKED_PREFETCH_MIN_ROWS),
                                                ("GenuineIntel", 1), ("", 1)])
def test_packed_prefetch_threshold_follows_the_cpu(monkeypatch: pytest.MonkeyPatch, vendor: str,
                                                   expected: int) -> None:
    monkeypatch.setattr("ksana.kernels.cpu.ops._cpu_vendor", lambda: vendor)
    assert packed_prefetch_min_rows() == expected


def test_native_ops_set_the_libraries_prefetch_threshold(library) -> None:
    original = library.set_packed_prefetch_min_rows(1)
    try:
        NativeCPUOps(library, prefetch_min_rows=7)
        assert library.set_packed_prefetch_min_rows(1) == 7
        NativeCPUOps(library)  # this CPU's
        assert library.set_packed_prefetch_min_rows(1) == packed_prefetch_min_rows()
    finally:
        library.set_packed_prefetch_min_rows(original)


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_linear_gives_the_same_bits_with_and_without_software_prefetch(packing: NativeCPUOps,
                                                                             library,
                                                                             dtype: torch.dtype) -> None:
    """Prefetching only moves weights into the caches earlier: every row count, with the tiles of fewer rows than
    the threshold left to the hardware prefetchers (17: all of them), gives what the prefetching tiles give."""
    torch.manual_seed(5)
    weight = (torch.randn(200, 96) / 96**0.5).to(dtype)
    bias = torch.randn(200).to(dtype)
    packed = packing.pack_weight(weight)
    x = torch.randn(20, 96).to(dtype)
    original = library.set_packed_prefetch_min_rows(1)
    try:
        prefetching = [packing.linear(x[:rows], packed, bias) for rows in range(1, 21)]
        library.set_packed_prefetch_min_rows(17)
        for rows, expected in enumerate(prefetching, start=1):
            assert torch.equal(packing.linear(x[:rows], packed, bias), expected), rows
    finally:
        library.set_packed_prefetch_min_rows(original)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_decode_layers_give_the_same_bits_without_software_prefetch(packing: NativeCPUOps,
                                                                         library, tmp_path,
                                                                         dtype: torch.dtype) -> None:
    """The fused step's tiles (gate-up-SwiGLU's pairs of panels too) at 1-4 rows, prefetching and not."""
    model_dir = make_checkpoint(tmp_path, "llama")
    cpu_ops()  # the models' ops, which set this CPU's threshold once, made before the settings below
    original = library.set_packed_prefetch_min_rows(1)
    try:
        for lengths in [(5,), (5, 9), (5, 9, 3), (5, 9, 3, 12)]:  # a decode row per sequence
            library.set_packed_prefetch_min_rows(1)
            prefetching = _decode_steps(load_model(model_dir, dtype=dtype), True, dtype, lengths=lengths)
            library.set_packed_prefetch_min_rows(17)
            plain = _decode_steps(load_model(model_dir, dtype=dtype), True, dtype, lengths=lengths)
            for a, b in zip(prefetching[0] + prefetching[1], plain[0] + plain[1], strict=True):
                assert torch.equal(a, b), lengths
    finally:
        library.set_packed_prefetch_min_rows(original)


def test_cpu_vendor_is_read_from_cpuinfo() -> None:
    with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
        vendors = {line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("vendor_id")}
    assert _cpu_vendor() in vendors


def test_plain_weights_and_other_dtypes_stay_with_blas(native: NativeCPUOps) -> None:
    x, weight = torch.randn(5, 64), torch.randn(32, 64)
    assert torch.equal(native.linear(x, weight), F.linear(x, weight))  # an unpacked weight: BLAS's own result
    half = torch.randn(32, 64).half()
    assert native.pack_weight(half) is half


def test_pack_weights_lays_the_packed_weights_back_to_back_in_the_order_given(native: NativeCPUOps) -> None:
    """One buffer per dtype, each weight starting where the one before it ends (a decode step's weights become
    one stream); unpackable weights come back as they are, in their place; each is read only when it is packed,
    so a caller can drop the originals as it goes. (Without AVX2 nothing packs: every weight comes back.)"""
    weights = [torch.randn(40, 24), torch.randn(16, 24).half(), torch.randn(33, 48), torch.randn(8, 24).bfloat16(),
               torch.randn(17, 24).bfloat16(), torch.randn(5, 7)]
    expected = [w.clone() for w in weights]
    results = []
    for i, result in enumerate(native.pack_weights(weights)):
        results.append(result)
        weights[i] = None  # what a model does; the next weight must still pack
    assert results[1] is not None and results[1].dtype == torch.float16 and torch.equal(results[1], expected[1])
    packed = [r for r in results if isinstance(r, PackedWeight)]
    assert len(packed) == (5 if native.has_linear else 0)
    for result, original in zip(results, expected, strict=True):
        assert torch.equal(dense_weight(result), original)
    for dtype in (torch.float32, torch.bfloat16) if packed else ():
        same = [r.packed for r in packed if r.dtype == dtype]
        base = same[0].untyped_storage().data_ptr()
        assert all(t.untyped_storage().data_ptr() == base for t in same), "one buffer per dtype"
        for before, after in zip(same, same[1:], strict=False):
            assert after.data_ptr() == before.data_ptr() + before.numel() * before.element_size()


def _decode_steps(model, use_fused: bool, dtype: torch.dtype, lengths: tuple[int, ...] = (1, 9, 16, 40, 3),
                  num_blocks: int = 32, head_major: bool = True) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A prefill of sequences of ``lengths`` (by default one past the SWA windows), then 3 all-decode steps; the
    decode steps' hidden states and the final KV cache (head-major, as the engine allocates it for these
    kernels, or slot-major)."""
    if not use_fused:
        model.ops = attrs.evolve(model.ops, decode_layers=None)
    seqs = [PagedSequence(t) for t in random_prompts(list(lengths), seed=5)]
    for seq, extra in zip(seqs, random_prompts([3] * len(seqs), seed=6), strict=True):
        seq.token_ids += extra
    cache = KVCache.allocate(model.shape, num_blocks, 8, dtype, "cpu", head_major=head_major)
    pool = BlockPool(num_blocks, seed=1)
    hidden_states = []
    with torch.inference_mode():
        plan = [(seq, len(seq.token_ids) - 3) for seq in seqs]
        for _ in range(4):
            input_ids, positions, meta = build_step(plan, 8, pool)
            hidden = model(input_ids, positions, cache.layers, meta)
            if meta.num_decodes == len(seqs):
                hidden_states.append(hidden)
            plan = [(seq, 1) for seq in seqs]
    return hidden_states, [t for pair in cache.layers for t in pair]


def _assert_fused_equals_loop(model_dir, dtype: torch.dtype, **steps) -> None:
    fused_model, loop_model = load_model(model_dir, dtype=dtype), load_model(model_dir, dtype=dtype)
    assert fused_model.ops.decode_layers is not None
    fused, fused_cache = _decode_steps(fused_model, True, dtype, **steps)
    loop, loop_cache = _decode_steps(loop_model, False, dtype, **steps)
    assert fused_model._decode_layers_of is not None  # the fused path really ran
    assert loop_model._decode_layers_of is None
    assert len(fused) == 3
    for a, b in zip(fused + fused_cache, loop + loop_cache, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("head_major", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ["llama", "qwen2-mixed-swa", "mistral"])
def test_fused_decode_layers_equal_the_layer_loop(packing: NativeCPUOps, tmp_path, dtype: torch.dtype,
                                                  family: str, head_major: bool) -> None:
    """Same kernels, same order: bit for bit the op-by-op result (biases, sliding windows, GQA), KV cache too,
    on either cache layout."""
    _assert_fused_equals_loop(make_checkpoint(tmp_path, family), dtype, head_major=head_major)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_decode_layers_give_the_same_bits_on_either_cache_layout(packing: NativeCPUOps, tmp_path,
                                                                      dtype: torch.dtype) -> None:
    model = load_model(make_checkpoint(tmp_path, "qwen2-mixed-swa"), dtype=dtype)
    assert model.kv_head_major  # what the engine allocates for these kernels
    head_major, head_major_cache = _decode_steps(model, True, dtype, head_major=True)
    slot_major, slot_major_cache = _decode_steps(model, True, dtype, head_major=False)
    assert not head_major_cache[0].is_contiguous() and slot_major_cache[0].is_contiguous()
    for a, b in zip(head_major + head_major_cache, slot_major + slot_major_cache, strict=True):
        assert torch.equal(a, b)


# Batch shapes that take the fused step's other paths (with 2 threads; 16 query heads of 64 make 300 positions
# enough work to split): one sequence's KV heads split along its positions across the threads; three sequences,
# a task per KV head, split; two short ones, a task per KV head, whole; 12 rows, two row tiles with a partial
# second; 16, the largest decode tile; 20 rows, past it (gate_up and SwiGLU as two passes there).
BATCH_SHAPES = {"one-long": (300,), "three-long": (290, 7, 300), "two-short": (5, 9), "12-rows": tuple(range(1, 13)),
                "16-rows": tuple(range(1, 17)), "20-rows": tuple(range(2, 42, 2))}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", BATCH_SHAPES)
def test_fused_decode_layers_equal_the_layer_loop_at_every_batch_shape(packing: NativeCPUOps, tmp_path,
                                                                      dtype: torch.dtype, shape: str) -> None:
    model_dir = make_checkpoint(tmp_path, "llama", num_attention_heads=16, head_dim=64)
    _assert_fused_equals_loop(model_dir, dtype, lengths=BATCH_SHAPES[shape], num_blocks=160)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ["qwen2-mixed-swa", "mistral"])
def test_fused_decode_layers_past_the_window_at_a_split_tile_batch(packing: NativeCPUOps, tmp_path,
                                                                  dtype: torch.dtype, family: str) -> None:
    """12 rows (the split tile's, where each thread's first attention task is its own sequence, whose KV the
    qkv projection warms) on sequences longer than the sliding windows: the warmed blocks start at the window."""
    _assert_fused_equals_loop(make_checkpoint(tmp_path, family), dtype, lengths=tuple(range(20, 44, 2)),
                              num_blocks=160)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [8, 12, 16])
def test_fused_decode_layers_equal_the_layer_loop_at_widths_off_the_vector_lanes(packing: NativeCPUOps, tmp_path,
                                                                                dtype: torch.dtype, rows: int) -> None:
    """Hidden 108 and intermediate 92: the tails of the row-tile packing (8 columns a transpose) and of the 16-lane
    SiLU (its own pass: gate_up and SwiGLU run as one only in whole panels), at one whole row tile, a whole and a
    partial one, and two whole ones."""
    model_dir = make_checkpoint(tmp_path, "llama", hidden_size=108, intermediate_size=92)
    _assert_fused_equals_loop(model_dir, dtype, lengths=tuple(range(3, 3 + rows)), num_blocks=160)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_decode_layers_equal_the_layer_loop_with_an_mlp_bias(packing: NativeCPUOps, tmp_path,
                                                                  dtype: torch.dtype) -> None:
    """A gate_up bias keeps gate_up and SwiGLU two passes in the fused step (the one-pass form adds no bias)."""
    model_dir = make_checkpoint(tmp_path, "llama", mlp_bias=True)
    _assert_fused_equals_loop(model_dir, dtype, lengths=tuple(range(3, 15)), num_blocks=160)


@pytest.mark.parametrize("family", ["llama", "qwen2-mixed-swa"])
def test_a_loaded_models_projections_are_one_stream_in_decode_order(packing: NativeCPUOps, tmp_path,
                                                                    family: str) -> None:
    """Layer by layer qkv, o, gate_up, down, then the head, each packed weight starting where the one before it
    ends; a tied embedding is the head's panels (one copy), and the model still counts every packed byte."""
    model = load_model(make_checkpoint(tmp_path, family), dtype=torch.float32)
    order = [w for layer in model.layers for w in (layer.self_attn.qkv_weight, layer.self_attn.o_weight,
                                                     layer.mlp.gate_up_weight, layer.mlp.down_weight)]
    order.append(model.lm_head_weight)
    assert all(isinstance(w, PackedWeight) for w in order)
    for before, after in zip(order, order[1:], strict=False):
        assert after.packed.data_ptr() == before.packed.data_ptr() + before.packed.numel() * 4
    if model.tied:
        assert model.embed_weight is model.lm_head_weight
    packed_bytes = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if "_packed" in name)
    assert packed_bytes == sum(w.packed.numel() * 4 for w in order)


def test_operators_name_what_they_cannot_take(library) -> None:
    """The operators check their arguments at the boundary: a wrong dtype, a device, a shape each give an error
    that names the argument, not a crash."""
    x = torch.randn(4, 64)
    with pytest.raises(RuntimeError, match="x must be float32 or bfloat16"):
        library.rms_norm(x.double(), torch.ones(64, dtype=torch.float64), 1e-6)
    with pytest.raises(RuntimeError, match="weight must be"):
        library.rms_norm(x, torch.ones(32), 1e-6)
    with pytest.raises(RuntimeError, match="silu_and_mul needs an even width"):
        library.silu_and_mul(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="cos and sin must be"):
        library.rotary_neox(torch.randn(3, 2, 8), torch.randn(3, 4), torch.randn(3, 8))
    with pytest.raises(RuntimeError, match="slot_mapping must be a CPU int64 tensor"):
        cache = torch.zeros(2, 4, 1, 8)
        library.store_kv(torch.randn(1, 1, 8), torch.randn(1, 1, 8), cache, cache.clone(), torch.tensor([0.0]))


def test_operators_have_fake_implementations_for_tracing(library) -> None:
    """On fake tensors the operators give their outputs' shapes and dtypes without running a kernel, which is what
    torch.compile traces with."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(5, 128)
        assert library.rms_norm(x, torch.empty(128), 1e-6).shape == (5, 128)
        assert library.silu_and_mul(x).shape == (5, 64)
        ids, logprobs = library.greedy_logprobs(torch.empty(3, 1000))
        assert (ids.shape, ids.dtype, logprobs.dtype) == ((3,), torch.int64, torch.float32)
        query = torch.empty(2, 6, 64, dtype=torch.bfloat16)
        cache = torch.empty(8, 16, 2, 64, dtype=torch.bfloat16)
        tables, lens = torch.zeros(2, 4, dtype=torch.int64), torch.ones(2, dtype=torch.int64)
        out = library.paged_decode(query, cache, cache, tables, lens, 0.125, 0)
        assert (out.shape, out.dtype) == ((2, 6, 64), torch.bfloat16)


def test_operators_show_in_the_profiler_by_name(native: NativeCPUOps) -> None:
    x, weight = torch.randn(4, 64), torch.randn(64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        native.rms_norm(x, weight, 1e-6)
        native.silu_and_mul(torch.randn(4, 32))
    names = {event.name for event in profile.events()}
    assert {"ksana::rms_norm", "ksana::silu_and_mul"} <= names


def test_operators_release_the_gil(packing: NativeCPUOps) -> None:
    """The engine's forward thread runs beside the event loop's: Python code keeps running while an operator
    computes on another thread. One long call (about a GFLOP): holding the GIL, it would leave this thread's loop
    no turn at all while it runs."""
    import threading

    weight = packing.pack_weight(torch.randn(2048, 2048))
    x = torch.randn(256, 2048)
    packing.linear(x, weight)  # warm
    ticks, start = 0, time.perf_counter()
    while time.perf_counter() - start < 0.05:
        ticks += 1
    alone_rate = ticks / (time.perf_counter() - start)
    seconds = []

    def compute() -> None:
        started = time.perf_counter()
        packing.linear(x, weight)
        seconds.append(time.perf_counter() - started)

    worker = threading.Thread(target=compute)
    ticks = 0
    worker.start()
    while worker.is_alive():
        ticks += 1
        time.perf_counter()  # the same work a tick as above
    worker.join()
    assert ticks > 0.05 * alone_rate * seconds[0], (ticks, alone_rate, seconds)
