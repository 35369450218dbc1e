"""Paged attention, torch reference path.

The KV cache of one layer is a pair of tensors ``[num_blocks, block_size, num_kv_heads, head_dim]``; a
sequence's keys live in the blocks its block table names, token ``p`` at slot ``block_table[p // B] * B + p % B``.
A cache may be a head-major view (each block ``[num_kv_heads, block_size, head_dim]`` in memory, see ``KVCache``):
these functions take either.
Masks follow Hugging Face: a query at position ``p`` sees keys at ``k <= p``, and with a sliding window ``W``
only ``p - W < k <= p`` (``transformers.masking_utils.sliding_window_overlay``).

Decode rows (one new token each) are computed together with one gather and one SDPA call; prefill rows loop
per sequence (on CPU, per chunk of ``PREFILL_QUERY_CHUNK`` queries). Grouped-query attention never copies K/V per
query head: decode folds the query heads of a KV group into SDPA's query-length dimension, prefill uses SDPA's
``enable_gqa``. On AVX2 CPUs the native kernels (``kernels/cpu``) take decode, and float32 prefill, instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from .attention_metadata import AttentionMetadata


# Queries per SDPA call in a CPU prefill. PyTorch's CPU flash attention computes each query block against
# whole key blocks of 512 and masks afterwards, so a causal prompt of 512 tokens costs about as much as a full
# 512 x 512 one. In chunks of 64, each over the keys it can see with its mask cut from one cached pattern
# (_causal_pattern), a layer skips most of the masked work; chunks of 128 do about as well, of 32 worse.
PREFILL_QUERY_CHUNK = 64


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[T, num_kv_heads, head_dim]`` into the cache slots ``slot_mapping`` ``[T]``."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    slots = slot_mapping.long()
    for cache, rows in ((k_cache, key), (v_cache, value)):
        if cache.is_contiguous():
            cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slots, rows)
        else:
            cache[slots // block_size, slots % block_size] = rows


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """``cache[block_ids]`` flattened per block (slot-major); an embedding lookup is several times faster than
    advanced indexing on CPU (one contiguous row copy per block). A head-major cache's blocks are gathered as
    they lie, then put in slot order."""
    if cache.is_contiguous():
        return F.embedding(block_ids, cache.view(cache.shape[0], -1))
    blocks = F.embedding(block_ids, cache.transpose(1, 2).reshape(cache.shape[0], -1))
    heads_first = blocks.view(*block_ids.shape, cache.shape[2], cache.shape[1], cache.shape[3])
    return heads_first.transpose(-3, -2).reshape(*block_ids.shape, -1)


def _window_blocks(sliding_window: int, block_size: int) -> int:
    """Most blocks that ``sliding_window`` consecutive positions can touch."""
    return (sliding_window + block_size - 2) // block_size + 1


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
    """Attention of one new token per sequence over its cached context.

    ``query`` ``[B, num_heads, head_dim]``; ``block_tables`` ``[B, max_blocks]``; ``seq_lens`` ``[B]`` counts the
    new token (already stored in the cache). ``max_seq_len`` (a Python int) avoids a device sync. With a
    sliding window only the blocks inside the window are gathered, so blocks that left it are never read.
    Returns ``[B, num_heads, head_dim]``.
    """
    batch, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    max_blocks = block_tables.shape[1]
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    num_blocks = min(max_blocks, -(-max_seq_len // block_size))
    device = query.device
    seq_lens = seq_lens.to(device=device, dtype=torch.long)

    if sliding_window is not None and _window_blocks(sliding_window, block_size) < num_blocks:
        num_blocks = _window_blocks(sliding_window, block_size)
        first_block = (seq_lens - sliding_window).clamp(min=0) // block_size  # [B]
        cols = first_block[:, None] + torch.arange(num_blocks, device=device)
        # Columns past the table's end only hold positions >= seq_len, which the mask hides.
        table = block_tables.gather(1, cols.clamp(max=max_blocks - 1))
        key_pos = (first_block * block_size)[:, None] + torch.arange(num_blocks * block_size, device=device)
    else:
        table = block_tables[:, :num_blocks]
        key_pos = torch.arange(num_blocks * block_size, device=device).expand(batch, -1)

    kv_len = num_blocks * block_size
    keys = _gather_blocks(k_cache, table).view(batch, kv_len, num_kv_heads, head_dim).transpose(1, 2)
    values = _gather_blocks(v_cache, table).view(batch, kv_len, num_kv_heads, head_dim).transpose(1, 2)
    mask = key_pos < seq_lens[:, None]
    if sliding_window is not None:
        mask &= key_pos >= (seq_lens - sliding_window)[:, None]
    out = F.scaled_dot_product_attention(
        query.view(batch, num_kv_heads, group, head_dim),
        keys,
        values,
        attn_mask=mask[:, None, None, :],
        scale=scale,
    )
    return out.reshape(batch, num_heads, head_dim)


CAUSAL_PATTERN_MAX = 1 << 21  # elements of a cached pattern at most (8 MiB of float32; 64 queries x 32K keys)


@functools.lru_cache(maxsize=4)
def _causal_pattern(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[rows, cols]`` additive mask, 0 where ``j <= i + cols - rows`` and -inf elsewhere: its bottom-right
    corners are the causal masks of every query chunk of a prefill (cached: a step's layers all ask for the same
    one, and building it costs about as much as a chunk's attention)."""
    i = torch.arange(rows, device=device)[:, None]
    j = torch.arange(cols, device=device)[None, :]
    return torch.zeros(rows, cols, dtype=dtype, device=device).masked_fill_(j > i + (cols - rows), float("-inf"))


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
    query_chunk: int | None = None,
) -> torch.Tensor:
    """Causal attention of one sequence's new tokens over its cached prefix and themselves.

    ``query`` ``[q_len, num_heads, head_dim]``; ``key``/``value`` ``[q_len, num_kv_heads, head_dim]`` are the
    new tokens' K/V (also already in the cache); ``block_table`` ``[max_blocks]``; ``seq_len`` includes the new
    tokens, which sit at positions ``seq_len - q_len .. seq_len - 1``. When every visible key is new, the
    cache is not read at all. Returns ``[q_len, num_heads, head_dim]``.

    The queries go ``query_chunk`` at a time (default: ``PREFILL_QUERY_CHUNK`` on CPU, all at once elsewhere),
    each over only the keys it can see: see ``PREFILL_QUERY_CHUNK``.
    """
    q_len = query.shape[0]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    context_len = seq_len - q_len
    first_key = 0 if sliding_window is None else max(0, context_len - sliding_window + 1)
    if first_key >= context_len:
        keys = key[first_key - context_len :]
        values = value[first_key - context_len :]
    else:
        first_block = first_key // block_size
        end_block = -(-seq_len // block_size)
        ids = block_table[first_block:end_block]
        lo, hi = first_key - first_block * block_size, seq_len - first_block * block_size
        keys = _gather_blocks(k_cache, ids).view(-1, num_kv_heads, head_dim)[lo:hi]
        values = _gather_blocks(v_cache, ids).view(-1, num_kv_heads, head_dim)[lo:hi]

    q = query.transpose(0, 1)[None]
    k = keys.transpose(0, 1)[None]
    v = values.transpose(0, 1)[None]
    if query_chunk is None:
        query_chunk = PREFILL_QUERY_CHUNK if query.device.type == "cpu" else q_len
    kv_len = keys.shape[0]
    outs = []
    for r0 in range(0, q_len, query_chunk):
        r1 = min(r0 + query_chunk, q_len)
        first_pos, end = context_len + r0, context_len + r1  # the chunk's queries are at [first_pos, end)
        # the first key any of them sees
        seen = first_key if sliding_window is None else max(first_key, first_pos - sliding_window + 1)
        chunk = {"query": q[:, :, r0:r1], "key": k[:, :, seen - first_key : end - first_key],
                 "value": v[:, :, seen - first_key : end - first_key], "scale": scale, "enable_gqa": True}
        if seen == first_pos and (sliding_window is None or sliding_window >= r1 - r0):
            # Queries and keys start at the same position: SDPA's top-left causal mask is this mask.
            outs.append(F.scaled_dot_product_attention(**chunk, is_causal=True))
            continue
        if sliding_window is None and query_chunk * kv_len <= CAUSAL_PATTERN_MAX:
            # Query first_pos + i sees key seen + j when j <= i + (first_pos - seen): a corner of the pattern.
            pattern = _causal_pattern(query_chunk, kv_len, query.dtype, query.device)
            mask = pattern[query_chunk - (r1 - r0) :, kv_len - (end - seen) :]
        else:
            q_pos = torch.arange(first_pos, end, device=query.device)[:, None]
            k_pos = torch.arange(seen, end, device=query.device)[None, :]
            mask = k_pos <= q_pos
            if sliding_window is not None:
                mask &= k_pos > q_pos - sliding_window
        outs.append(F.scaled_dot_product_attention(**chunk, attn_mask=mask))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out[0].transpose(0, 1)


def compose_paged_attention(store_kv_cache: Callable, decode: Callable, prefill: Callable) -> Callable:
    """``paged_attention`` from its three steps, so perf mode can time each step of the same algorithm."""

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
        """One layer's attention for a packed batch: store the new K/V, then attend through the block tables.

        ``query`` ``[T, num_heads, head_dim]``, ``key``/``value`` ``[T, num_kv_heads, head_dim]`` in the cache
        dtype. Decode rows (the first ``meta.num_decodes``) go in one call, prefill rows one sequence at a time.
        Returns ``[T, num_heads, head_dim]``.
        """
        store_kv_cache(key, value, k_cache, v_cache, meta.slot_mapping)
        query_lens = meta.query_lens_list or meta.query_start_loc.diff().tolist()
        seq_lens = meta.seq_lens_list or meta.seq_lens.tolist()
        num_decodes = meta.num_decodes
        outs = []
        if num_decodes:
            outs.append(decode(query[:num_decodes], k_cache, v_cache, meta.block_tables[:num_decodes],
                               meta.seq_lens[:num_decodes], scale, sliding_window, max(seq_lens[:num_decodes])))
        start = num_decodes
        for i in range(num_decodes, len(seq_lens)):
            end = start + query_lens[i]
            outs.append(prefill(query[start:end], key[start:end], value[start:end], k_cache, v_cache,
                                meta.block_tables[i], seq_lens[i], scale, sliding_window))
            start = end
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    return paged_attention


paged_attention = compose_paged_attention(store_kv_cache, paged_decode_attention, paged_prefill_attention)
