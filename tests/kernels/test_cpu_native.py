"""The native CPU kernels (kernels/cpu) against the torch reference ops and the dense attention reference."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kernels import attention, norm, rotary
from kernels.backends import cpu_ops
from kernels.cpu import load_library
from kernels.cpu.ops import NativeCPUOps
from tests.kernels.test_attention import HEAD_DIM, ROWS, dense_reference, make_batch

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def native() -> NativeCPUOps:
    library = load_library()
    assert library is not None, "the C kernels must build on the test machine (gcc is part of the image)"
    return NativeCPUOps(library)


def test_cpu_dispatch_picks_the_native_kernels() -> None:
    ops = cpu_ops()
    assert ops.name == "cpu-native"
    assert ops.paged_prefill_attention is attention.paged_prefill_attention


def test_portable_build_without_avx2_matches_the_reference(tmp_path) -> None:
    """The plain C decode path (what CPUs without AVX2/FMA run), built into a fresh cache."""
    code = """
import torch
from kernels import attention
from kernels.cpu import load_library
from kernels.cpu.build import compiler_flags
from kernels.cpu.ops import NativeCPUOps
from tests.kernels.test_attention import make_batch
assert "-mavx2" not in compiler_flags()
native = NativeCPUOps(load_library())
# 5 sequences: one task per sequence on 2 threads; 2: one task per KV head.
for rows in ([(1, 1), (1, 17), (1, 90), (1, 33), (1, 5)], [(1, 17), (1, 90)]):
    (k_cache, v_cache), (q, _, _), meta, _, _ = make_batch(rows, 6, 2, 16)
    for window in (None, 20):
        args = (q, k_cache, v_cache, meta.block_tables, meta.seq_lens, 0.25, window)
        torch.testing.assert_close(native.paged_decode_attention(*args), attention.paged_decode_attention(*args))
"""
    env = {**os.environ, "KSANA_CPU_KERNELS": "portable", "KSANA_CACHE_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    assert list(tmp_path.glob("cpu-kernels-*/libksana_cpu.so"))


def test_env_switch_falls_back_to_the_torch_reference() -> None:
    code = "from kernels import get_ops; from kernels.dispatch import TORCH_OPS; assert get_ops('cpu') is TORCH_OPS"
    env = {**os.environ, "KSANA_CPU_KERNELS": "torch"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_and_fused_add(native: NativeCPUOps, dtype: torch.dtype, rows: int) -> None:
    torch.manual_seed(rows)
    weight = torch.randn(576).to(dtype)
    x = (torch.randn(rows, 576) * 3).to(dtype)
    residual = torch.randn(rows, 576).to(dtype)
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


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16])
def test_store_kv_writes_exactly_the_given_slots(native: NativeCPUOps, dtype: torch.dtype) -> None:
    k_cache, v_cache = torch.zeros(6, 4, 3, 8, dtype=dtype), torch.zeros(6, 4, 3, 8, dtype=dtype)
    qkv = torch.randn(5, 9, 8).to(dtype)  # key and value are strided views, as in the decoder
    key, value = qkv[:, 3:6], qkv[:, 6:9]
    slots = torch.tensor([23, 0, 5, 6, 17])
    native.store_kv_cache(key, value, k_cache, v_cache, slots)
    ref_k, ref_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    attention.store_kv_cache(key, value, ref_k, ref_v, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("window", [None, 1, 6, 37])
@pytest.mark.parametrize("heads", [(6, 2), (5, 5), (12, 3), (7, 1)])
def test_native_paged_attention_matches_dense(heads: tuple[int, int], window: int | None, block_size: int) -> None:
    num_heads, num_kv_heads = heads
    (k_cache, v_cache), (q, k, v), meta, full_k, full_v = make_batch(ROWS, num_heads, num_kv_heads, block_size)
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


def test_unsupported_dtype_uses_the_reference(native: NativeCPUOps) -> None:
    x, weight = torch.randn(3, 16).half(), torch.randn(16).half()
    assert torch.equal(native.rms_norm(x, weight, 1e-6), norm.rms_norm(x, weight, 1e-6))
