"""The native CPU kernels behind the torch reference signatures, so ``KernelOps`` can swap them in.

Each wrapper checks what the C code assumes (a supported dtype, unit stride in the last dimension, head rows
``head_dim`` apart) and otherwise returns the torch reference's result, so callers never have to care.
"""

from __future__ import annotations

import ctypes

import torch

from kernels import activation, attention, norm, rotary
from kernels.cpu.build import DTYPE_SUFFIX, SIGNATURES


class NativeCPUOps:
    """Bound kernels of one loaded library; methods mirror the torch reference functions."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._fns = {(name, dtype): getattr(library, f"{name}_{suffix}")
                     for name in SIGNATURES for dtype, suffix in DTYPE_SUFFIX.items()}

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not _rows_ok(x, weight):
            return norm.rms_norm(x, weight, eps)
        rows = x.reshape(-1, x.shape[-1])
        out = torch.empty(rows.shape, dtype=x.dtype)
        self._fns["rms_norm", x.dtype](rows.data_ptr(), rows.stride(0), None, None, weight.data_ptr(),
                                       out.data_ptr(), rows.shape[0], rows.shape[1], eps, torch.get_num_threads())
        return out.view(x.shape)

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if not (_rows_ok(x, weight) and residual.is_contiguous() and residual.shape == x.shape
                and residual.dtype == x.dtype):
            return norm.fused_add_rms_norm(x, residual, weight, eps)
        rows = x.reshape(-1, x.shape[-1])
        out, new_residual = torch.empty(rows.shape, dtype=x.dtype), torch.empty(rows.shape, dtype=x.dtype)
        self._fns["rms_norm", x.dtype](rows.data_ptr(), rows.stride(0), residual.data_ptr(), new_residual.data_ptr(),
                                       weight.data_ptr(), out.data_ptr(), rows.shape[0], rows.shape[1], eps,
                                       torch.get_num_threads())
        return out.view(x.shape), new_residual.view(x.shape)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in DTYPE_SUFFIX or x.stride(-1) != 1:
            return activation.silu_and_mul(x)
        rows = x.reshape(-1, x.shape[-1])
        d = rows.shape[1] // 2
        out = torch.empty((rows.shape[0], d), dtype=x.dtype)
        self._fns["silu_and_mul", x.dtype](rows.data_ptr(), rows.stride(0), out.data_ptr(), rows.shape[0], d,
                                           torch.get_num_threads())
        return out.view(*x.shape[:-1], d)

    def apply_rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     is_neox: bool = True) -> torch.Tensor:
        num_tokens, num_heads, head_dim = x.shape
        if not (is_neox and _heads_ok(x) and cos.dtype == sin.dtype == x.dtype and cos.is_contiguous()
                and sin.is_contiguous()):
            return rotary.apply_rotary(x, cos, sin, is_neox)
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=x.dtype)
        self._fns["rotary_neox", x.dtype](x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
                                          num_tokens, num_heads, head_dim, torch.get_num_threads())
        return out

    def store_kv_cache(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
        if not (_heads_ok(key) and _heads_ok(value) and key.dtype == value.dtype == k_cache.dtype
                and k_cache.is_contiguous() and v_cache.is_contiguous() and slot_mapping.dtype == torch.int64
                and slot_mapping.is_contiguous()):
            return attention.store_kv_cache(key, value, k_cache, v_cache, slot_mapping)
        num_tokens, num_kv_heads, head_dim = key.shape
        self._fns["store_kv", key.dtype](key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
                                         k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(), num_tokens,
                                         num_kv_heads * head_dim)
        return None

    def paged_decode_attention(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                               sliding_window: int | None = None, max_seq_len: int | None = None) -> torch.Tensor:
        if not (_heads_ok(query) and query.dtype == k_cache.dtype and k_cache.is_contiguous()
                and v_cache.is_contiguous() and block_tables.dtype == seq_lens.dtype == torch.int64
                and block_tables.stride(-1) == 1 and seq_lens.is_contiguous()):
            return attention.paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale,
                                                    sliding_window, max_seq_len)
        batch, num_heads, head_dim = query.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        out = torch.empty((batch, num_heads, head_dim), dtype=query.dtype)
        self._fns["paged_decode", query.dtype](
            query.data_ptr(), query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
            block_tables.stride(0), seq_lens.data_ptr(), out.data_ptr(), batch, num_heads, num_kv_heads, head_dim,
            block_size, scale, sliding_window or 0, torch.get_num_threads())
        return out


def _rows_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """A row-wise op can run natively: supported dtype, the weight's too, and contiguous rows."""
    return (x.dtype in DTYPE_SUFFIX and weight.dtype == x.dtype and weight.is_contiguous() and x.stride(-1) == 1
            and (x.dim() == 1 or x.dim() == 2 or x.is_contiguous()))


def _heads_ok(x: torch.Tensor) -> bool:
    """``[T, heads, head_dim]`` with each token's heads packed (the C code steps tokens by ``stride(0)``)."""
    return x.dim() == 3 and x.dtype in DTYPE_SUFFIX and x.stride(2) == 1 and x.stride(1) == x.shape[2]
