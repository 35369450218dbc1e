"""The Ascend path: torch-npu's fused operators where they exist, the torch reference elsewhere.

``torch_npu`` is imported under a guard, so this module imports (and every op works, through the reference) on
machines without it; ``is_npu_available()`` says whether an NPU can actually be used. Each op takes the fused
path only for tensors on an NPU and falls back to the reference otherwise, so the same function is correct on
any device. Fused operators used (torch-npu custom API):

- ``npu_rms_norm(x, gamma, epsilon) -> (y, rstd)`` and
  ``npu_add_rms_norm(x1, x2, gamma, epsilon) -> (y, rstd, x1 + x2)``; their half-precision rounding is the
  operator's own, so results may differ from the reference's (Hugging Face's) in the last place;
- ``npu_rotary_mul(x, r1, r2, rotary_mode)`` ('half' = neox; 'interleave' = gptj, newer torch-npu only);
- ``npu_swiglu(x, dim=-1)`` (SiLU of the first half times the second half).

Paged attention and the KV-cache store use the reference: torch-npu's fused attention
(``npu_fused_infer_attention_score``) needs half-precision inputs and its own cache layout, which is left for
a change that can be tested on Ascend hardware.
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch

from . import activation, norm, rotary

logger = logging.getLogger(__name__)


def _import_torch_npu() -> ModuleType | None:
    try:
        import torch_npu  # optional: the `npu` extra installs it
    except Exception as exc:  # ImportError, or a broken CANN install raising at import time
        logger.debug("torch_npu unavailable: %s", exc)
        return None
    return torch_npu


torch_npu = _import_torch_npu()
# Set once an older torch-npu rejects ``rotary_mode``; gptj rotary then stays on the reference.
_interleave_unsupported = False


def is_npu_available() -> bool:
    """torch_npu imports and at least one NPU is visible."""
    if torch_npu is None:
        return False
    npu = getattr(torch, "npu", None)
    try:
        return bool(npu is not None and npu.is_available())
    except Exception:  # a driver error means no usable device
        return False


def _fused(*tensors: torch.Tensor) -> bool:
    return torch_npu is not None and all(t.device.type == "npu" for t in tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As ``kernels.norm.rms_norm``; fused when ``x`` and ``weight`` share an NPU and a dtype."""
    if _fused(x, weight) and x.dtype == weight.dtype:
        return torch_npu.npu_rms_norm(x, weight, epsilon=eps)[0]
    return norm.rms_norm(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``kernels.norm.fused_add_rms_norm``: ``(normed, x + residual)``."""
    if _fused(x, residual, weight) and x.dtype == residual.dtype == weight.dtype:
        normed, _, summed = torch_npu.npu_add_rms_norm(x, residual, weight, eps)
        return normed, summed
    return norm.fused_add_rms_norm(x, residual, weight, eps)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool = True) -> torch.Tensor:
    """As ``kernels.rotary.apply_rotary``; ``x`` ``[T, H, D]`` goes in as BSND with B = 1, cos/sin as 1S1D."""
    global _interleave_unsupported
    if _fused(x, cos, sin) and x.dtype == cos.dtype == sin.dtype and (is_neox or not _interleave_unsupported):
        r1, r2 = cos[None, :, None, :], sin[None, :, None, :]
        if is_neox:
            return torch_npu.npu_rotary_mul(x[None], r1, r2)[0]
        try:
            return torch_npu.npu_rotary_mul(x[None], r1, r2, rotary_mode="interleave")[0]
        except TypeError:  # torch-npu before the rotary_mode argument
            _interleave_unsupported = True
    return rotary.apply_rotary(x, cos, sin, is_neox)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """As ``kernels.activation.silu_and_mul`` (torch-npu calls it SwiGLU)."""
    if _fused(x):
        return torch_npu.npu_swiglu(x.contiguous(), dim=-1)
    return activation.silu_and_mul(x)
