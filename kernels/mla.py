"""Paged multi-head latent attention (DeepSeek-V2/V3 MLA), torch reference path.

One layer's cache is a pair of one-head block pools: ``latent_cache`` ``[num_blocks, block_size, 1, kv_lora_rank]``
holds each token's normed KV latent ``c``, ``rope_cache`` ``[num_blocks, block_size, 1, qk_rope_head_dim]`` its
rotated decoupled key ``k_rope``; token ``p`` sits at slot ``block_table[p // B] * B + p % B``, as in
``attention.py``. Per head ``h`` the model's ``kv_b_proj`` expands ``c`` into a key part ``W_UK[h] c`` and a value
``W_UV[h] c``; the key of head ``h`` is ``[W_UK[h] c ; k_rope]``.

Decode runs absorbed: the model folds ``W_UK`` into the query (``q_latent = W_UK[h]^T q_nope``), so a score is
``q_latent . c + q_rope . k_rope`` over the cached latent itself, with no per-head keys or values made, and
``mla_decode_attention`` returns the softmax-weighted latent, to which the model applies ``W_UV``. Prefill expands
the context's latent into per-head keys and values (``gather_latent``, then the model's ``kv_b_proj``) and runs
``mla_prefill_attention``, an ordinary causal attention with a value size of its own.

``first_key``: keys before this position are hidden from every later query (a multi-token-prediction module's
cache has no real entry at position 0); a query before it sees only itself, so its row stays finite. Scores,
softmax and the weighted sum are computed in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import _gather_blocks


def store_latent(latent: torch.Tensor, k_rope: torch.Tensor, latent_cache: torch.Tensor, rope_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Write ``latent`` ``[T, kv_lora_rank]`` and ``k_rope`` ``[T, qk_rope_head_dim]`` into slots ``slot_mapping``."""
    slots = slot_mapping.long()
    for cache, rows in ((latent_cache, latent), (rope_cache, k_rope)):
        num_blocks, block_size, heads, dim = cache.shape
        rows = rows.reshape(-1, heads, dim).to(cache.dtype)
        if cache.is_contiguous():
            cache.view(num_blocks * block_size, heads, dim).index_copy_(0, slots, rows)
        else:
            cache[slots // block_size, slots % block_size] = rows


def gather_latent(latent_cache: torch.Tensor, rope_cache: torch.Tensor, block_table: torch.Tensor,
                  seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's first ``seq_len`` positions: ``(latent [seq_len, kv_lora_rank], k_rope [seq_len, rope])``."""
    block_size = latent_cache.shape[1]
    ids = block_table[: -(-seq_len // block_size)]
    latent = _gather_blocks(latent_cache, ids).view(-1, latent_cache.shape[-1])[:seq_len]
    rope = _gather_blocks(rope_cache, ids).view(-1, rope_cache.shape[-1])[:seq_len]
    return latent, rope


def mla_decode_attention(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
    first_key: int = 0,
) -> torch.Tensor:
    """Absorbed attention of one new token per sequence over its cached latents.

    ``q_latent`` ``[B, num_heads, kv_lora_rank]`` (the no-rope query folded through ``W_UK``), ``q_rope``
    ``[B, num_heads, qk_rope_head_dim]`` (rotated); ``seq_lens`` ``[B]`` counts the new token, already stored.
    Returns the attention-weighted latent ``[B, num_heads, kv_lora_rank]`` in ``q_latent``'s dtype.
    """
    batch = q_latent.shape[0]
    block_size = latent_cache.shape[1]
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    num_blocks = min(block_tables.shape[1], -(-max_seq_len // block_size))
    table = block_tables[:, :num_blocks]
    kv_len = num_blocks * block_size
    latent = _gather_blocks(latent_cache, table).view(batch, kv_len, -1).float()
    rope = _gather_blocks(rope_cache, table).view(batch, kv_len, -1).float()
    scores = torch.bmm(q_latent.float(), latent.transpose(1, 2))
    scores += torch.bmm(q_rope.float(), rope.transpose(1, 2))
    seq_lens = seq_lens.to(device=q_latent.device, dtype=torch.long)
    key_pos = torch.arange(kv_len, device=q_latent.device)[None, :]
    visible = key_pos < seq_lens[:, None]
    if first_key:
        visible &= key_pos >= (seq_lens - 1).clamp(max=first_key)[:, None]
    scores = (scores * scale).masked_fill_(~visible[:, None, :], float("-inf"))
    return torch.bmm(torch.softmax(scores, dim=-1), latent).to(q_latent.dtype)


def mla_prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                          first_key: int = 0) -> torch.Tensor:
    """Causal attention of one sequence's last ``q_len`` positions over all its ``kv_len`` positions.

    ``query`` ``[q_len, num_heads, qk_head_dim]``, ``key`` ``[kv_len, num_heads, qk_head_dim]``, ``value``
    ``[kv_len, num_heads, v_head_dim]`` (expanded from the latent); the queries sit at positions
    ``kv_len - q_len .. kv_len - 1``. Returns ``[q_len, num_heads, v_head_dim]`` in ``query``'s dtype.
    """
    q_len, kv_len = query.shape[0], key.shape[0]
    q, k, v = (t.transpose(0, 1).float() for t in (query, key, value))
    if kv_len == q_len and not first_key:
        out = F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=True)
    else:
        q_pos = torch.arange(kv_len - q_len, kv_len, device=query.device)[:, None]
        k_pos = torch.arange(kv_len, device=query.device)[None, :]
        mask = (k_pos <= q_pos) & (k_pos >= q_pos.clamp(max=first_key))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(0, 1).to(query.dtype)
