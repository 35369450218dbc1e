"""KV-cache store: scatter each new token's K/V rows into its cache slot.

One program per token writes all of its KV heads for both K and V. A negative slot (vLLM's padding convention)
is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kc_block,
    stride_kc_token,
    stride_kc_head,
    stride_vc_block,
    stride_vc_token,
    stride_vc_head,
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads < num_kv_heads)[:, None] & (dims < head_dim)[None, :]
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    key = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    value = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    k_dst = k_cache_ptr + block * stride_kc_block + offset * stride_kc_token
    v_dst = v_cache_ptr + block * stride_vc_block + offset * stride_vc_token
    tl.store(
        k_dst + heads[:, None] * stride_kc_head + dims[None, :],
        key.to(k_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        v_dst + heads[:, None] * stride_vc_head + dims[None, :],
        value.to(v_cache_ptr.dtype.element_ty),
        mask=mask,
    )


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[T, num_kv_heads, head_dim]`` into the slots ``slot_mapping`` ``[T]``."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("store_kv_cache: the cache's head_dim must be contiguous")
    key, value = _unit_last(key), _unit_last(value)
    block_h = triton.next_power_of_2(num_kv_heads)
    block_d = triton.next_power_of_2(head_dim)
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping.contiguous(),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        num_kv_heads,
        head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=max(1, min(8, block_h * block_d // 256)),
    )
