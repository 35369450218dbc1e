"""Paged attention: a grouped-query decode kernel and a variable-length prefill kernel, flash-style.

Both read K/V straight from the paged cache ``[num_blocks, block_size, num_kv_heads, head_dim]``: each key
position is mapped through the block table to its block, so any block size works and no K/V is gathered or
copied. Softmax is online (running max and sum in float32), so a program streams its keys once. Masks follow
``kernels.attention``: a query at position ``p`` sees keys ``k <= p`` and, with a sliding window ``W``, only
``p - W < k <= p``; the key loop starts at the window, so blocks that left it are never read.

- decode: one program per (sequence, KV head) computes all query heads of the group together, so each K/V row
  is loaded once per group; the group is padded to 16 rows for ``tl.dot``.
- prefill: one program per (sequence, tile of ``BLOCK_M`` new tokens, query head); the new tokens' K/V are
  read back from the cache where ``store_kv_cache`` just put them, so a chunk over a cached prefix is the same
  code.

float32 inputs use IEEE float32 dots (no TF32) so results agree with the torch reference to float32 tolerance;
half-precision inputs use the tensor cores with float32 accumulation. Under the interpreter everything is
upcast to float32 (its half-precision arithmetic is not faithful).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from ._common import is_interpreted, tl_dtype
from .cache import store_kv_cache

if TYPE_CHECKING:
    from ..attention_metadata import AttentionMetadata

_LOG2E = 1.4426950408889634
_MIN_DOT = 16  # tl.dot needs every dimension >= 16


@triton.jit
def _load_kv_tile(
    table, pos, key_mask, dims, dim_mask, kv_head,
    k_cache_ptr, v_cache_ptr, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    BLOCK_SIZE: tl.constexpr, COMPUTE_DTYPE: tl.constexpr,
):
    """One tile of keys and values at positions ``pos``, read through the block table (masked rows are 0)."""
    blocks = tl.load(table + pos // BLOCK_SIZE, mask=key_mask, other=0).to(tl.int64)
    slots = pos % BLOCK_SIZE
    kv_mask = key_mask[:, None] & dim_mask[None, :]
    k = tl.load(
        k_cache_ptr + blocks[:, None] * stride_kb + slots[:, None] * stride_kt + kv_head * stride_kh + dims[None, :],
        mask=kv_mask,
        other=0.0,
    ).to(COMPUTE_DTYPE)
    v = tl.load(
        v_cache_ptr + blocks[:, None] * stride_vb + slots[:, None] * stride_vt + kv_head * stride_vh + dims[None, :],
        mask=kv_mask,
        other=0.0,
    ).to(COMPUTE_DTYPE)
    return k, v


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    scale_log2e,
    window,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_ob,
    stride_oh,
    group,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    rows = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    row_mask = rows < group
    dim_mask = dims < head_dim
    heads = kv_head * group + rows
    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    ).to(COMPUTE_DTYPE)

    first = 0
    if HAS_WINDOW:
        first = tl.maximum(seq_len - window, 0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    for start in range(first, seq_len, BLOCK_N):
        pos = start + offs_n
        key_mask = pos < seq_len
        k, v = _load_kv_tile(
            table, pos, key_mask, dims, dim_mask, kv_head,
            k_cache_ptr, v_cache_ptr, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            BLOCK_SIZE, COMPUTE_DTYPE,
        )
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2e
        scores = tl.where(key_mask[None, :], scores, float("-inf"))
        # Every tile holds at least one visible key (start < seq_len), so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE_DTYPE), v, input_precision=PRECISION)
        m_i = m_new
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dim_mask[None, :],
    )


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    scale_log2e,
    window,
    first_seq,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    group,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = first_seq + tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // group
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    context_len = seq_len - q_len

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    row_mask = rows < q_len
    dim_mask = dims < head_dim
    q_pos = context_len + rows
    tokens = (q_start + rows).to(tl.int64)
    q = tl.load(
        q_ptr + tokens[:, None] * stride_qt + head * stride_qh + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    ).to(COMPUTE_DTYPE)

    # Keys this tile can see: causal up to its last row, and from its first row's window start.
    end = tl.minimum(seq_len, context_len + (tile + 1) * BLOCK_M)
    first = 0
    if HAS_WINDOW:
        first = tl.maximum(context_len + tile * BLOCK_M - window + 1, 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    for start in range(first, end, BLOCK_N):
        pos = start + offs_n
        key_mask = pos < end
        k, v = _load_kv_tile(
            table, pos, key_mask, dims, dim_mask, kv_head,
            k_cache_ptr, v_cache_ptr, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            BLOCK_SIZE, COMPUTE_DTYPE,
        )
        visible = key_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2e
        scores = tl.where(visible, scores, float("-inf"))
        # A row may see nothing in this tile (window not reached yet): keep its max finite to avoid inf - inf.
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE_DTYPE), v, input_precision=PRECISION)
        m_i = m_new
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + tokens[:, None] * stride_ot + head * stride_oh + dims[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dim_mask[None, :],
    )


def _compute(dtype: torch.dtype) -> tuple[tl.dtype, str]:
    """(dtype fed to ``tl.dot``, its input precision) for K/V and queries of ``dtype``."""
    if dtype == torch.float32 or is_interpreted():
        return tl.float32, "ieee"
    return tl_dtype(dtype), "tf32"  # precision is ignored for half-precision operands


def _tile(block_d: int, compute_dtype: tl.dtype) -> int:
    """Query/key tile length: 64 rows of up to 256 bytes each, halved per doubling of the row's bytes, so the
    operand tiles stay within shared memory (fp32 with head_dim 128 would need ~115 KB at 64)."""
    row_bytes = block_d * compute_dtype.primitive_bitwidth // 8
    return max(_MIN_DOT, 64 * 256 // max(row_bytes, 256))


def _check(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or query.stride(-1) != 1:
        raise ValueError("paged attention: head_dim must be contiguous in the query and the cache")
    if query.shape[1] % k_cache.shape[2]:
        raise ValueError(f"paged attention: {query.shape[1]} query heads for {k_cache.shape[2]} KV heads")
    if k_cache.dtype != v_cache.dtype:
        raise TypeError("paged attention: K and V caches must share a dtype")


def _launch_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
) -> None:
    batch, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if batch == 0:
        return
    group = num_heads // num_kv_heads
    # No-ops for the engine's tensors; the kernels index the last dimension with unit stride.
    block_tables, seq_lens = block_tables.contiguous(), seq_lens.contiguous()
    compute_dtype, precision = _compute(k_cache.dtype)
    block_d = max(_MIN_DOT, triton.next_power_of_2(head_dim))
    _decode_kernel[(batch, num_kv_heads)](
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        scale * _LOG2E,
        sliding_window or 0,
        query.stride(0),
        query.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        group,
        head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_G=max(_MIN_DOT, triton.next_power_of_2(group)),
        BLOCK_N=_tile(block_d, compute_dtype),
        BLOCK_D=block_d,
        HAS_WINDOW=sliding_window is not None,
        COMPUTE_DTYPE=compute_dtype,
        PRECISION=precision,
        num_warps=4,
    )


def _launch_prefill(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    first_seq: int,
    num_seqs: int,
    max_query_len: int,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
) -> None:
    """Attention of sequences ``first_seq`` to ``first_seq + num_seqs - 1`` (rows as ``query_start_loc``)."""
    num_heads, head_dim = query.shape[1:]
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_seqs == 0 or max_query_len == 0:
        return
    block_tables, seq_lens = block_tables.contiguous(), seq_lens.contiguous()
    query_start_loc = query_start_loc.contiguous()
    compute_dtype, precision = _compute(k_cache.dtype)
    block_d = max(_MIN_DOT, triton.next_power_of_2(head_dim))
    tile = _tile(block_d, compute_dtype)
    block_m = min(tile, max(_MIN_DOT, triton.next_power_of_2(max_query_len)))
    grid = (num_seqs, triton.cdiv(max_query_len, block_m), num_heads)
    _prefill_kernel[grid](
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        scale * _LOG2E,
        sliding_window or 0,
        first_seq,
        query.stride(0),
        query.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        num_heads // num_kv_heads,
        head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=tile,
        BLOCK_D=block_d,
        HAS_WINDOW=sliding_window is not None,
        COMPUTE_DTYPE=compute_dtype,
        PRECISION=precision,
        num_warps=4 if block_d <= 64 else 8,
    )


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over its cached context (as ``kernels.attention``).

    ``max_seq_len`` is accepted for signature parity; the kernel reads each sequence's length on the device.
    """
    del max_seq_len
    _check(query, k_cache, v_cache)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    _launch_decode(query, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, out)
    return out


def paged_prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of one sequence's new tokens over its cached prefix (as ``kernels.attention``).

    The new tokens' ``key``/``value`` must already be in the cache (the reference's contract too); the kernel
    reads every key from there.
    """
    del key, value
    _check(query, k_cache, v_cache)
    q_len = query.shape[0]
    device = query.device
    out = torch.empty(query.shape, dtype=query.dtype, device=device)
    _launch_prefill(
        query,
        k_cache,
        v_cache,
        block_table.reshape(1, -1),
        torch.tensor([seq_len], dtype=torch.int32, device=device),
        torch.tensor([0, q_len], dtype=torch.int32, device=device),
        0,
        1,
        q_len,
        scale,
        sliding_window,
        out,
    )
    return out


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """One layer's attention for a packed batch (as ``kernels.attention.paged_attention``): store the new K/V,
    then one decode launch for the leading decode rows and one prefill launch for all the other sequences."""
    _check(query, k_cache, v_cache)
    store_kv_cache(key, value, k_cache, v_cache, meta.slot_mapping)
    return attend_cached(query, k_cache, v_cache, meta, scale, sliding_window)


def attend_cached(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """``paged_attention`` after the store: both launches read every key from the cache. Apart, so that perf
    mode can time the store and the attention separately without changing the launches."""
    _check(query, k_cache, v_cache)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_decodes = meta.num_decodes
    num_seqs = meta.seq_lens.shape[0]
    if num_decodes:
        _launch_decode(
            query[:num_decodes],
            k_cache,
            v_cache,
            meta.block_tables[:num_decodes],
            meta.seq_lens[:num_decodes],
            scale,
            sliding_window,
            out[:num_decodes],
        )
    if num_seqs > num_decodes:
        if meta.query_lens_list:
            max_query_len = max(meta.query_lens_list[num_decodes:])
        else:
            max_query_len = int(meta.query_start_loc.diff()[num_decodes:].max())
        _launch_prefill(
            query,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            num_decodes,
            num_seqs - num_decodes,
            max_query_len,
            scale,
            sliding_window,
            out,
        )
    return out
