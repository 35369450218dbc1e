"""Triton paged attention and KV store against the torch reference (``kernels.attention``).

Runs under ``TRITON_INTERPRET=1`` on CPU (see conftest.py), natively on CUDA. Shapes are tiny but cover what
the kernels special-case: non-power-of-two head counts and head dims (padded inside the kernels), grouped
query heads, block sizes that are not powers of two, lengths that end mid-block and on a block edge, chunks
over a cached prefix starting mid-block and on a block edge, contexts longer than one key tile (64) and one
query tile, and sliding windows smaller than the context.
"""

from __future__ import annotations

import random

import pytest
import torch

from ksana.kernels import attention as reference
from ksana.kernels.attention_metadata import AttentionMetadata
from ksana.kernels.triton import attention as triton_attention
from ksana.kernels.triton.cache import store_kv_cache


def rows_for(block_size: int) -> list[tuple[int, int]]:
    """``(q_len, seq_len)`` rows: decodes first (as the engine orders them), then prefills."""
    b = block_size
    return [
        (1, 1),  # first token
        (1, b + 3),  # ends mid-block
        (1, 2 * b),  # ends on a block edge
        (1, 150),  # three key tiles
        (7, 7),  # fresh prompt, mid-block
        (2 * b, 2 * b),  # fresh prompt ending on a block edge
        (9, b + 11),  # chunk over a cached prefix that ends mid-block
        (b, 2 * b),  # chunk starting and ending on block edges
        (20, 150),  # chunk over a long prefix: three key tiles
        (70, 70),  # two query tiles
        (2, 2 * b + 5),
    ]


def make_batch(rows, num_heads, num_kv_heads, head_dim, block_size, device, dtype=torch.float32, seed=0):
    """Random cache (its slots hold each row's cached context), new q/k/v, and the batch metadata."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_row = [-(-seq_len // block_size) for _, seq_len in rows]
    num_blocks = sum(blocks_per_row) + 1  # block 0 stays unused: table padding names it
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen)
    v_cache = torch.randn(cache_shape, generator=gen)
    free = list(range(1, num_blocks))
    random.Random(seed).shuffle(free)
    tables, slots = [], []
    for (q_len, seq_len), n in zip(rows, blocks_per_row, strict=True):
        table = [free.pop() for _ in range(n)]
        tables.append(table)
        slots += [
            table[p // block_size] * block_size + p % block_size for p in range(seq_len - q_len, seq_len)
        ]
    num_tokens = sum(q for q, _ in rows)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    width = max(blocks_per_row)
    query_lens = [q for q, _ in rows]
    seq_lens = [s for _, s in rows]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device),
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], device=device),
        seq_lens=torch.tensor(seq_lens, device=device),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device),
        block_size=block_size,
        num_decodes=sum(1 for q in query_lens if q == 1),
        max_seq_len=max(seq_lens),
        query_lens_list=query_lens,
        seq_lens_list=seq_lens,
    )
    tensors = [t.to(device=device, dtype=dtype) for t in (query, key, value, k_cache, v_cache)]
    return tensors, meta


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size", "window"),
    [
        (7, 1, 24, 16, None),  # one KV head, a group of 7
        (6, 3, 40, 5, 7),  # window smaller than most contexts, block size not a power of two
        (4, 4, 24, 8, 16),  # no grouping; window a multiple of the block size
        (8, 2, 16, 16, 1),  # group of 4; a window of one key
    ],
)
def test_paged_attention_matches_reference(
    num_heads, num_kv_heads, head_dim, block_size, window, triton_device
):
    rows = rows_for(block_size)
    (query, key, value, k_cache, v_cache), meta = make_batch(
        rows, num_heads, num_kv_heads, head_dim, block_size, triton_device
    )
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    scale = head_dim**-0.5
    out = triton_attention.paged_attention(query, key, value, k_cache, v_cache, meta, scale, window)
    expected = reference.paged_attention(query, key, value, ref_k, ref_v, meta, scale, window)
    assert out.shape == query.shape and out.dtype == query.dtype
    torch.testing.assert_close(k_cache, ref_k, rtol=0, atol=0)
    torch.testing.assert_close(v_cache, ref_v, rtol=0, atol=0)
    start = 0
    for i, (q_len, _) in enumerate(rows):
        torch.testing.assert_close(
            out[start : start + q_len], expected[start : start + q_len], rtol=1e-5, atol=1e-5, msg=f"row {i}"
        )
        start += q_len


def test_strided_qkv_views_and_int32_metadata(triton_device):
    """The decoder passes q/k/v as views of one fused qkv tensor; the engine may use int32 metadata."""
    rows = [(1, 9), (1, 33), (5, 21), (12, 12)]
    num_heads, num_kv_heads, head_dim = 6, 2, 24
    (query, key, value, k_cache, v_cache), meta = make_batch(
        rows, num_heads, num_kv_heads, head_dim, 8, triton_device
    )
    qkv = torch.cat([query, key, value], dim=1)
    query, key, value = qkv[:, :num_heads], qkv[:, num_heads : num_heads + 2], qkv[:, num_heads + 2 :]
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    expected = reference.paged_attention(query, key, value, ref_k, ref_v, meta, 0.2, 10)
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        setattr(meta, name, getattr(meta, name).int())
    meta.query_lens_list = []  # forces the on-device max query length
    out = triton_attention.paged_attention(query, key, value, k_cache, v_cache, meta, 0.2, 10)
    torch.testing.assert_close(k_cache, ref_k, rtol=0, atol=0)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 4, 13])
def test_standalone_decode_and_prefill_never_read_outside_the_window(window, triton_device):
    """Blocks wholly before a sequence's first visible key hold NaN: a kernel that reads them returns NaN."""
    block_size, head_dim = 4, 24
    rows = [(1, 61), (1, 23), (1, 9), (11, 50)]
    (query, key, value, k_cache, v_cache), meta = make_batch(
        rows, 6, 3, head_dim, block_size, triton_device, seed=1
    )
    store_kv_cache(key, value, k_cache, v_cache, meta.slot_mapping)
    clean_k, clean_v = k_cache.clone(), v_cache.clone()  # the reference reads and masks whole blocks
    if window is not None:
        for table, (q_len, seq_len) in zip(meta.block_tables, rows, strict=True):
            first_visible = max(0, seq_len - q_len - window + 1)
            for b in table[: first_visible // block_size].tolist():
                k_cache[b] = float("nan")
                v_cache[b] = float("nan")
    scale = head_dim**-0.5
    decode_args = (meta.block_tables[:3], meta.seq_lens[:3], scale, window)
    out = triton_attention.paged_decode_attention(query[:3], k_cache, v_cache, *decode_args)
    expected = reference.paged_decode_attention(query[:3], clean_k, clean_v, *decode_args)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    prefill_args = (key[3:], value[3:])
    table, seq_len = meta.block_tables[3], rows[3][1]
    out = triton_attention.paged_prefill_attention(
        query[3:], *prefill_args, k_cache, v_cache, table, seq_len, scale, window
    )
    expected = reference.paged_prefill_attention(
        query[3:], *prefill_args, clean_k, clean_v, table, seq_len, scale, window
    )
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_bfloat16_close_to_float32_reference(triton_device):
    rows = [(1, 5), (1, 40), (9, 30), (16, 16)]
    (query, key, value, k_cache, v_cache), meta = make_batch(rows, 6, 2, 24, 16, triton_device)
    expected = reference.paged_attention(query, key, value, k_cache.clone(), v_cache.clone(), meta, 0.2, 6)
    half = [t.to(torch.bfloat16) for t in (query, key, value, k_cache, v_cache)]
    out = triton_attention.paged_attention(*half, meta, 0.2, 6)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=0.03, atol=0.03)


def test_store_kv_cache_matches_reference_and_skips_negative_slots(triton_device):
    k_cache = torch.zeros(5, 3, 3, 40, device=triton_device)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(4, 3, 40, device=triton_device)
    value = torch.randn(4, 3, 40, device=triton_device)
    slots = torch.tensor(
        [14, 0, 7, 3], dtype=torch.int32, device=triton_device
    )  # 14: the last slot; 3: block edge
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    reference.store_kv_cache(key, value, ref_k, ref_v, slots)
    store_kv_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    store_kv_cache(key + 1, value + 1, k_cache, v_cache, torch.full((4,), -1, device=triton_device))
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
