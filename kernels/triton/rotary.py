"""Rotary embedding: the neox (two halves) and gptj (adjacent pairs) layouts in one kernel.

Each program rotates a tile of heads of one token; the cos/sin row is read once per token and shared by all
its heads. The input may be a strided view (the query and key heads of the fused qkv output), the result is
new.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Tiles hold at most this many (head, pair) elements per program.
_MAX_TILE = 4096


@triton.jit
def _rotary_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    stride_xt,
    stride_xh,
    stride_cos,
    stride_sin,
    stride_ot,
    stride_oh,
    num_heads,
    half_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    pairs = tl.arange(0, BLOCK_HALF)
    pair_mask = pairs < half_dim
    mask = (heads < num_heads)[:, None] & pair_mask[None, :]
    if IS_NEOX:
        first = pairs
        second = pairs + half_dim
    else:
        first = 2 * pairs
        second = 2 * pairs + 1
    cos1 = tl.load(cos_ptr + token * stride_cos + first, mask=pair_mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + token * stride_cos + second, mask=pair_mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + token * stride_sin + first, mask=pair_mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + token * stride_sin + second, mask=pair_mask, other=0.0).to(tl.float32)
    x_row = x_ptr + token * stride_xt + heads[:, None] * stride_xh
    x1 = tl.load(x_row + first[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + second[None, :], mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * cos1[None, :] - x2 * sin1[None, :]
    out2 = x2 * cos2[None, :] + x1 * sin2[None, :]
    out_row = out_ptr + token * stride_ot + heads[:, None] * stride_oh
    tl.store(out_row + first[None, :], out1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_row + second[None, :], out2.to(out_ptr.dtype.element_ty), mask=mask)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool = True) -> torch.Tensor:
    """Rotate ``x`` ``[T, num_heads, head_dim]`` by the per-token ``cos``/``sin`` ``[T, head_dim]``."""
    num_tokens, num_heads, head_dim = x.shape
    if head_dim % 2:
        raise ValueError(f"apply_rotary: head_dim {head_dim} must be even")
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    out_dtype = torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype)
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=out_dtype, device=x.device)
    if num_tokens == 0 or num_heads == 0:
        return out
    half_dim = head_dim // 2
    block_half = triton.next_power_of_2(half_dim)
    block_h = min(triton.next_power_of_2(num_heads), max(1, _MAX_TILE // block_half))
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    _rotary_kernel[grid](
        x,
        cos,
        sin,
        out,
        x.stride(0),
        x.stride(1),
        cos.stride(0),
        sin.stride(0),
        out.stride(0),
        out.stride(1),
        num_heads,
        half_dim,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        IS_NEOX=is_neox,
        num_warps=4,
    )
    return out
