"""RMSNorm and residual-add RMSNorm: one program per row, the whole row in registers.

Rounding follows ``kernels.norm`` (Hugging Face): the residual sum and the normalized row are rounded to the
model dtype before the weight multiplies them, so half-precision results match the reference to the last bit
except for the order of the variance sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import rows_with_unit_stride

# One row lives in registers; wider rows would spill (no model has hidden sizes near this).
MAX_HIDDEN = 65536


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_residual,
    stride_out,
    stride_residual_out,
    num_cols,
    eps,
    BLOCK_N: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < num_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (x + residual).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_residual_out + cols, summed, mask=mask)
        x = summed.to(tl.float32)
        norm_dtype = residual_out_ptr.dtype.element_ty
    else:
        norm_dtype = x_ptr.dtype.element_ty
    variance = tl.sum(x * x, axis=0) / num_cols
    normed = (x * tl.rsqrt(variance + eps)).to(norm_dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    shape = x.shape
    num_cols = shape[-1]
    if num_cols > MAX_HIDDEN:
        raise ValueError(f"rms_norm: hidden size {num_cols} exceeds {MAX_HIDDEN}")
    x2 = rows_with_unit_stride(x)
    norm_dtype = x.dtype
    residual2 = residual_out = None
    if residual is not None:
        residual2 = rows_with_unit_stride(residual)
        norm_dtype = torch.promote_types(x.dtype, residual.dtype)
        residual_out = torch.empty(x2.shape, dtype=norm_dtype, device=x.device)
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, norm_dtype), device=x.device)
    num_rows = x2.shape[0]
    if num_rows:
        block_n = triton.next_power_of_2(num_cols)
        _rms_norm_kernel[(num_rows,)](
            x2,
            residual2 if residual2 is not None else x2,
            weight.contiguous(),
            out,
            residual_out if residual_out is not None else out,
            x2.stride(0),
            residual2.stride(0) if residual2 is not None else 0,
            out.stride(0),
            residual_out.stride(0) if residual_out is not None else 0,
            num_cols,
            eps,
            BLOCK_N=block_n,
            HAS_RESIDUAL=residual is not None,
            num_warps=min(16, max(1, block_n // 256)),
        )
    out = out.view(shape)
    return out, None if residual_out is None else residual_out.view(shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * normalize(x)`` over the last dimension (as ``kernels.norm.rms_norm``)."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)`` in one pass over memory; inputs are not modified."""
    out, new_residual = _launch(x, residual, weight, eps)
    return out, new_residual
