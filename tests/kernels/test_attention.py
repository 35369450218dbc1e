"""Paged attention against a dense, float64 reference (causal, grouped-query, sliding window)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from ksana.kernels import attention
from ksana.kernels.attention import (
    PREFILL_QUERY_CHUNK,
    paged_attention,
    paged_decode_attention,
    paged_prefill_attention,
    store_kv_cache,
)
from ksana.kernels.attention_metadata import AttentionMetadata

HEAD_DIM = 8
NUM_BLOCKS = 96


def dense_reference(q, k, v, seq_len: int, window: int | None) -> torch.Tensor:
    """q ``[q_len, H, D]`` for the last q_len positions; k/v ``[seq_len, Hkv, D]`` the whole context."""
    q_len, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / math.sqrt(q.shape[-1])
    q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    k_pos = torch.arange(seq_len)[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window  # HF: kv_idx > q_idx - sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def make_batch(
    rows: list[tuple[int, int]], num_heads: int, num_kv_heads: int, block_size: int, seed: int = 0,
    head_major: bool = False,
):
    """Rows ``(q_len, seq_len)``; returns the cache with contexts stored, new q/k/v, metadata, full k/v per row.
    ``head_major``: the caches are head-major views (as ``KVCache.allocate(head_major=True)`` makes them)."""
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(NUM_BLOCKS, block_size, num_kv_heads, HEAD_DIM, generator=gen)
    v_cache = torch.randn(NUM_BLOCKS, block_size, num_kv_heads, HEAD_DIM, generator=gen)
    free = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(free)
    full_k, full_v, tables, slots, queries = [], [], [], [], []
    for q_len, seq_len in rows:
        blocks = [free.pop() for _ in range(-(-seq_len // block_size))]
        tables.append(blocks)
        k = torch.randn(seq_len, num_kv_heads, HEAD_DIM, generator=gen)
        v = torch.randn(seq_len, num_kv_heads, HEAD_DIM, generator=gen)
        row_slots = torch.tensor(
            [blocks[p // block_size] * block_size + p % block_size for p in range(seq_len)]
        )
        context = seq_len - q_len
        k_cache.view(-1, num_kv_heads, HEAD_DIM)[row_slots[:context]] = k[:context]
        v_cache.view(-1, num_kv_heads, HEAD_DIM)[row_slots[:context]] = v[:context]
        slots.append(row_slots[context:])
        full_k.append(k)
        full_v.append(v)
        queries.append(torch.randn(q_len, num_heads, HEAD_DIM, generator=gen))
    max_blocks = max(map(len, tables))
    query_lens = [q for q, _ in rows]
    seq_lens = [s for _, s in rows]
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()]),
        seq_lens=torch.tensor(seq_lens),
        block_tables=torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables]),
        block_size=block_size,
        num_decodes=next((i for i, q in enumerate(query_lens) if q != 1), len(rows)),
        max_seq_len=max(seq_lens),
        query_lens_list=query_lens,
        seq_lens_list=seq_lens,
    )
    new_k = torch.cat([k[s - q :] for k, (q, s) in zip(full_k, rows, strict=True)])
    new_v = torch.cat([v[s - q :] for v, (q, s) in zip(full_v, rows, strict=True)])
    if head_major:
        k_cache, v_cache = (as_head_major(c) for c in (k_cache, v_cache))
    return (k_cache, v_cache), (torch.cat(queries), new_k, new_v), meta, full_k, full_v


def as_head_major(cache: torch.Tensor) -> torch.Tensor:
    """The same values, each block laid out head by head in memory (same shape and indexing)."""
    copy = cache.transpose(1, 2).contiguous().transpose(1, 2)
    assert torch.equal(copy, cache) and copy.transpose(1, 2).is_contiguous()
    return copy


# Decode rows first (context lengths 1, mid-block, block edge, long), then prefills: fresh, fresh on a block
# edge, chunks over a cached prefix (mid-block start, block-edge start), a one-token-longer chunk.
ROWS = [(1, 1), (1, 6), (1, 16), (1, 17), (1, 90), (7, 7), (16, 16), (10, 50), (33, 80), (2, 64), (40, 40)]


@pytest.mark.parametrize("head_major", [False, True])
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("window", [None, 1, 6, 16, 37])
@pytest.mark.parametrize("heads", [(6, 2), (5, 5), (12, 3), (7, 1)])
def test_paged_attention_matches_dense(heads: tuple[int, int], window: int | None, block_size: int,
                                       head_major: bool) -> None:
    num_heads, num_kv_heads = heads
    (k_cache, v_cache), (q, k, v), meta, full_k, full_v = make_batch(
        ROWS, num_heads, num_kv_heads, block_size, head_major=head_major
    )
    out = paged_attention(q, k, v, k_cache, v_cache, meta, HEAD_DIM**-0.5, window)
    assert out.shape == q.shape
    start = 0
    for i, (q_len, seq_len) in enumerate(ROWS):
        ref = dense_reference(q[start : start + q_len], full_k[i], full_v[i], seq_len, window)
        torch.testing.assert_close(
            out[start : start + q_len].double(), ref, rtol=1e-5, atol=1e-5, msg=f"row {i}"
        )
        start += q_len


# Prefills only: fresh, over a cached prefix, and two longer than the CPU's default query chunk.
CHUNKED_ROWS = [(40, 40), (33, 80), (16, 16), (10, 50), (2, 64), (7, 7), (PREFILL_QUERY_CHUNK + 6,) * 2,
                (PREFILL_QUERY_CHUNK + 26, PREFILL_QUERY_CHUNK + 56)]


@pytest.mark.parametrize("cached_pattern", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("query_chunk", [None, 1, 3, 16])
@pytest.mark.parametrize("window", [None, 1, 6, 37])
@pytest.mark.parametrize("heads", [(6, 2), (7, 1)])
def test_prefill_in_query_chunks_matches_dense(heads: tuple[int, int], window: int | None,
                                               query_chunk: int | None, dtype: torch.dtype, cached_pattern: bool,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Every query chunk attends only the keys it can see, through its corner of the cached causal pattern (or,
    past the pattern's size limit or with a window, a mask of its own); the chunks together give the dense
    result."""
    if not cached_pattern:
        monkeypatch.setattr(attention, "CAUSAL_PATTERN_MAX", 0)
    (k_cache, v_cache), (q, k, v), meta, full_k, full_v = make_batch(CHUNKED_ROWS, *heads, 5, head_major=True)
    k_cache, v_cache, q, k, v = (t.to(dtype) for t in (k_cache, v_cache, q, k, v))
    store_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    tolerance = 1e-5 if dtype == torch.float32 else 0.05
    start = 0
    for i, (q_len, seq_len) in enumerate(CHUNKED_ROWS):
        rows = slice(start, start + q_len)
        out = paged_prefill_attention(q[rows], k[rows], v[rows], k_cache, v_cache, meta.block_tables[i], seq_len,
                                      HEAD_DIM**-0.5, window, query_chunk)
        assert out.dtype == dtype
        ref = dense_reference(q[rows].float(), full_k[i], full_v[i], seq_len, window)
        torch.testing.assert_close(out.double(), ref, rtol=tolerance, atol=tolerance, msg=f"row {i}")
        start += q_len


def test_new_kv_lands_in_its_slots() -> None:
    (k_cache, v_cache), (q, k, v), meta, full_k, _ = make_batch(ROWS, 4, 2, 16)
    before = k_cache.clone()
    paged_attention(q, k, v, k_cache, v_cache, meta, HEAD_DIM**-0.5)
    flat = k_cache.view(-1, 2, HEAD_DIM)
    torch.testing.assert_close(flat[meta.slot_mapping], k, rtol=0, atol=0)
    torch.testing.assert_close(v_cache.view(-1, 2, HEAD_DIM)[meta.slot_mapping], v, rtol=0, atol=0)
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[meta.slot_mapping] = False
    torch.testing.assert_close(flat[untouched], before.view(-1, 2, HEAD_DIM)[untouched], rtol=0, atol=0)


def test_store_writes_the_same_values_into_a_head_major_cache() -> None:
    (k_cache, v_cache), (_, k, v), meta, _, _ = make_batch(ROWS, 6, 3, 5)
    head_k, head_v = as_head_major(k_cache), as_head_major(v_cache)
    store_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    store_kv_cache(k, v, head_k, head_v, meta.slot_mapping)
    assert torch.equal(head_k, k_cache) and torch.equal(head_v, v_cache)
    assert not head_k.is_contiguous() and head_k.transpose(1, 2).is_contiguous()  # written in place, not copied


def test_store_kv_cache_accepts_int32_slots() -> None:
    k_cache = torch.zeros(4, 2, 1, 3)
    v_cache = torch.zeros(4, 2, 1, 3)
    key = torch.arange(6.0).view(2, 1, 3)
    store_kv_cache(key, -key, k_cache, v_cache, torch.tensor([7, 2], dtype=torch.int32))
    assert torch.equal(k_cache[3, 1, 0], key[0, 0]) and torch.equal(v_cache[1, 0, 0], -key[1, 0])
    assert int((k_cache != 0).sum()) == 5  # key[0] contains one zero


@pytest.mark.parametrize("window", [3, 16, 21])
def test_blocks_outside_the_window_are_never_read(window: int) -> None:
    """A sliding-window layer's blocks before its window may be reused or garbage: they must not be read.

    Block 0 is spared: padding entries of block tables name it, and padding is read then masked, which is why
    ``KVCache.allocate`` zero-fills (cache contents must be finite).
    """
    block_size = 4
    rows = [(1, 61), (1, 23), (1, 9), (12, 70), (5, 5)]
    (k_cache, v_cache), (q, k, v), meta, full_k, full_v = make_batch(rows, 6, 3, block_size, seed=1)
    for i, (q_len, seq_len) in enumerate(rows):
        first_visible = max(0, seq_len - q_len - window + 1)
        for b in meta.block_tables[i, : first_visible // block_size].tolist():
            if b == 0:
                continue
            k_cache[b] = float("nan")
            v_cache[b] = float("nan")
    out = paged_attention(q, k, v, k_cache, v_cache, meta, HEAD_DIM**-0.5, window)
    start = 0
    for i, (q_len, seq_len) in enumerate(rows):
        ref = dense_reference(q[start : start + q_len], full_k[i], full_v[i], seq_len, window)
        torch.testing.assert_close(out[start : start + q_len].double(), ref, rtol=1e-5, atol=1e-5)
        start += q_len


def test_decode_without_python_max_syncs_to_same_result() -> None:
    (k_cache, v_cache), (q, k, v), meta, full_k, full_v = make_batch([(1, 30), (1, 3), (1, 47)], 6, 2, 8)
    store_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    args = (q, k_cache, v_cache, meta.block_tables, meta.seq_lens, HEAD_DIM**-0.5, 10)
    torch.testing.assert_close(paged_decode_attention(*args), paged_decode_attention(*args, max_seq_len=47))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_close_to_dense(dtype: torch.dtype) -> None:
    (k_cache, v_cache), (q, k, v), meta, full_k, full_v = make_batch(ROWS, 6, 2, 16)
    out = paged_attention(
        q.to(dtype), k.to(dtype), v.to(dtype), k_cache.to(dtype), v_cache.to(dtype), meta, HEAD_DIM**-0.5, 16
    )
    assert out.dtype == dtype
    start = 0
    for i, (q_len, seq_len) in enumerate(ROWS):
        ref = dense_reference(q[start : start + q_len], full_k[i], full_v[i], seq_len, 16)
        torch.testing.assert_close(out[start : start + q_len].double(), ref, rtol=0.05, atol=0.05)
        start += q_len


def test_int32_block_tables_and_slots_give_same_result() -> None:
    (k_cache, v_cache), (q, k, v), meta, _, _ = make_batch(ROWS, 6, 2, 16)
    expected = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, HEAD_DIM**-0.5, 6)
    meta.block_tables = meta.block_tables.int()
    meta.slot_mapping = meta.slot_mapping.int()
    meta.seq_lens = meta.seq_lens.int()
    torch.testing.assert_close(paged_attention(q, k, v, k_cache, v_cache, meta, HEAD_DIM**-0.5, 6), expected)
