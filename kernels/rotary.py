"""Rotary position embedding.

``rotary_cos_sin`` is computed once per forward pass (shared by all layers); ``apply_rotary`` rotates any
number of heads at once, so a model rotates its query and key heads with one call on the fused qkv output.
"""

from __future__ import annotations

import torch


def rotary_cos_sin(
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float,
    dtype: torch.dtype,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[T, head_dim]`` for ``positions`` (int [T]), computed in float32 then cast, as HF does.

    neox layout repeats the frequencies as two halves, gptj layout interleaves them pairwise.
    """
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1) if is_neox else freqs.repeat_interleave(2, dim=-1)
    cos = emb.cos() * attention_scaling
    sin = emb.sin() * attention_scaling
    return cos.to(dtype), sin.to(dtype)


def _rotate_neox(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_gptj(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool = True) -> torch.Tensor:
    """Rotate ``x`` ``[T, num_heads, head_dim]`` by the per-token ``cos``/``sin`` ``[T, head_dim]``."""
    cos = cos[:, None, :]
    sin = sin[:, None, :]
    rotated = _rotate_neox(x) if is_neox else _rotate_gptj(x)
    return x * cos + rotated * sin
