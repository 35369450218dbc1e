"""RMSNorm, computed the way Hugging Face does (variance in float32, weight applied in the model dtype)."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * normalize(x)``; the variance is taken in float32 so bf16/fp16 match HF's rounding."""
    input_dtype = x.dtype
    x32 = x.float()
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(input_dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add ``x`` to the residual stream, then normalize it; returns ``(normed, new_residual)``.

    The decoder keeps the residual separately so each layer needs one call here instead of an add and a norm
    (a fused kernel on accelerators); the sum is done in the model dtype, as HF does.
    """
    residual = x + residual
    return rms_norm(residual, weight, eps), residual
