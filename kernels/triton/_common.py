"""Launch-time helpers shared by the Triton kernels."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def is_interpreted() -> bool:
    """True under ``TRITON_INTERPRET=1``, whose half-precision arithmetic is not faithful: kernels upcast."""
    knobs = getattr(triton, "knobs", None)  # triton >= 3.3; older releases read the variable directly
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def tl_dtype(dtype: torch.dtype) -> tl.dtype:
    """The Triton element type for a supported torch dtype (float32, float16, bfloat16)."""
    try:
        return _TL_DTYPES[dtype]
    except KeyError:
        raise TypeError(f"Triton kernels support float32, float16 and bfloat16, not {dtype}") from None


def rows_with_unit_stride(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, last_dim]`` whose last dimension is contiguous; copies only when it must."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.reshape(-1, x.shape[-1])
