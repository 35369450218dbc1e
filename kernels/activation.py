"""SiLU-and-mul for gated MLPs whose gate and up projections are fused into one matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` where ``x`` is the output of the fused ``[gate; up]`` projection."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]
