"""The one place that picks kernel implementations per device.

Models hold the ``KernelOps`` returned by ``get_ops(device)`` and call ops only through it, so adding Triton or
torch-npu kernels is a change here and nowhere else. Today every device maps to the torch reference path.
"""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType

import attrs
import torch

from kernels import activation, attention, norm, rotary


@attrs.frozen
class KernelOps:
    """A consistent set of op implementations (signatures as in the torch modules of this package)."""

    name: str
    rms_norm: Callable = attrs.field(repr=False)
    fused_add_rms_norm: Callable = attrs.field(repr=False)
    silu_and_mul: Callable = attrs.field(repr=False)
    rotary_cos_sin: Callable = attrs.field(repr=False)
    apply_rotary: Callable = attrs.field(repr=False)
    store_kv_cache: Callable = attrs.field(repr=False)
    paged_attention: Callable = attrs.field(repr=False)


TORCH_OPS = KernelOps(
    name="torch",
    rms_norm=norm.rms_norm,
    fused_add_rms_norm=norm.fused_add_rms_norm,
    silu_and_mul=activation.silu_and_mul,
    rotary_cos_sin=rotary.rotary_cos_sin,
    apply_rotary=rotary.apply_rotary,
    store_kv_cache=attention.store_kv_cache,
    paged_attention=attention.paged_attention,
)

_OPS_BY_DEVICE_TYPE = MappingProxyType({"cpu": TORCH_OPS, "cuda": TORCH_OPS})


def get_ops(device: str | torch.device) -> KernelOps:
    """Kernels for ``device``; device types without a dedicated entry use the torch path."""
    return _OPS_BY_DEVICE_TYPE.get(torch.device(device).type, TORCH_OPS)
