"""Model kernels: a torch reference for each op, picked per device by ``kernels.dispatch.get_ops``."""

from .activation import silu_and_mul
from .attention import (
    paged_attention,
    paged_decode_attention,
    paged_prefill_attention,
    store_kv_cache,
)
from .dispatch import KernelOps, get_ops
from .norm import fused_add_rms_norm, rms_norm
from .rotary import apply_rotary, rotary_cos_sin

__all__ = [
    "KernelOps",
    "apply_rotary",
    "fused_add_rms_norm",
    "get_ops",
    "paged_attention",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "rotary_cos_sin",
    "silu_and_mul",
    "store_kv_cache",
]
