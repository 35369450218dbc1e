"""Triton RMSNorm, rotary and SiLU-and-mul against their torch references (``kernels/*.py``).

Runs under ``TRITON_INTERPRET=1`` on CPU (see conftest.py), natively on CUDA. Widths are chosen to be padded
inside the kernels (non-powers of two) and inputs are strided views where the decoder passes views.
"""

from __future__ import annotations

import pytest
import torch

from ksana.kernels import activation, norm, rotary
from ksana.kernels.backends import triton_ops
from ksana.kernels.triton import activation as triton_activation
from ksana.kernels.triton import attention as triton_attention
from ksana.kernels.triton import cache as triton_cache
from ksana.kernels.triton import norm as triton_norm
from ksana.kernels.triton import rotary as triton_rotary

# The interpreter rounds float32 -> bfloat16 by truncation, so bfloat16 is compared within one unit (2**-7).
TOLERANCE = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 1.6e-2, "atol": 1.6e-2}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [40, 96])
def test_rms_norm_and_fused_add(dtype, hidden, triton_device):
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(7, hidden, generator=gen) * 3).to(triton_device, dtype)
    residual = torch.randn(7, hidden, generator=gen).to(triton_device, dtype)
    weight = torch.randn(hidden, generator=gen).to(triton_device, dtype)
    out = triton_norm.rms_norm(x, weight, 1e-5)
    assert out.dtype == dtype
    torch.testing.assert_close(out, norm.rms_norm(x, weight, 1e-5), **TOLERANCE[dtype])
    normed, new_residual = triton_norm.fused_add_rms_norm(x, residual, weight, 1e-5)
    ref_normed, ref_residual = norm.fused_add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(new_residual, ref_residual, **TOLERANCE[dtype])
    torch.testing.assert_close(normed, ref_normed, **TOLERANCE[dtype])


def test_rms_norm_strided_3d_input_and_float32_weight(triton_device):
    """Rows of a non-contiguous 3-D view; a float32 weight on bfloat16 activations promotes the output."""
    base = torch.randn(3, 5, 2 * 24, device=triton_device)
    x = base[:, :, ::2]  # last dim strided: copied
    weight = torch.randn(24, device=triton_device)
    torch.testing.assert_close(triton_norm.rms_norm(x, weight, 1e-6), norm.rms_norm(x, weight, 1e-6))
    rows = base[:, 1, :24]  # row-strided 2-D view: read in place
    torch.testing.assert_close(triton_norm.rms_norm(rows, weight, 1e-6), norm.rms_norm(rows, weight, 1e-6))
    half = x.to(torch.bfloat16)
    out = triton_norm.rms_norm(half, weight, 1e-6)
    assert out.dtype == torch.float32 == norm.rms_norm(half, weight, 1e-6).dtype
    torch.testing.assert_close(out, norm.rms_norm(half, weight, 1e-6), **TOLERANCE[torch.bfloat16])


def test_fused_add_rms_norm_leaves_inputs_untouched(triton_device):
    x = torch.randn(4, 40, device=triton_device)
    residual = torch.randn(4, 40, device=triton_device)
    before = (x.clone(), residual.clone())
    triton_norm.fused_add_rms_norm(x, residual, torch.ones(40, device=triton_device), 1e-6)
    assert torch.equal(x, before[0]) and torch.equal(residual, before[1])


def _inv_freq(head_dim: int) -> torch.Tensor:
    return 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(6, 3, 24), (5, 1, 40), (4, 2, 16)])
def test_apply_rotary_on_fused_qkv_view(is_neox, num_heads, num_kv_heads, head_dim, triton_device):
    """Query and key heads rotated together through a strided view of the fused qkv output, as decoders do."""
    positions = torch.tensor([0, 5, 1, 300, 17, 4096], device=triton_device)
    num_tokens = positions.shape[0]
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=triton_device)
    qk = qkv[:, : (num_heads + num_kv_heads) * head_dim].view(num_tokens, num_heads + num_kv_heads, head_dim)
    cos, sin = rotary.rotary_cos_sin(
        positions, _inv_freq(head_dim).to(triton_device), 1.0, torch.float32, is_neox
    )
    out = triton_rotary.apply_rotary(qk, cos, sin, is_neox)
    torch.testing.assert_close(out, rotary.apply_rotary(qk, cos, sin, is_neox), rtol=1e-5, atol=1e-5)


def test_apply_rotary_bfloat16_and_many_heads(triton_device):
    """More heads than one tile holds (several programs per token) and half-precision tables."""
    head_dim = 256  # 128 pairs per head: 32 heads per tile, so 40 heads take two tiles
    x = torch.randn(3, 40, head_dim, device=triton_device).to(torch.bfloat16)
    cos, sin = rotary.rotary_cos_sin(
        torch.tensor([3, 9, 27], device=triton_device),
        _inv_freq(head_dim).to(triton_device),
        1.0,
        torch.bfloat16,
    )
    out = triton_rotary.apply_rotary(x, cos, sin)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, rotary.apply_rotary(x, cos, sin), rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [24, 1500])  # 1500: two column tiles of 1024
def test_silu_and_mul(dtype, d, triton_device):
    x = (torch.randn(2, 3, 2 * d, device=triton_device) * 4).to(dtype)
    out = triton_activation.silu_and_mul(x)
    assert out.shape == (2, 3, d) and out.dtype == dtype
    torch.testing.assert_close(out, activation.silu_and_mul(x), **TOLERANCE[dtype])


def test_triton_ops_swap_every_kernel_but_the_cos_sin_table():
    ops = triton_ops()
    assert ops.name == "triton"
    assert ops.rms_norm is triton_norm.rms_norm
    assert ops.fused_add_rms_norm is triton_norm.fused_add_rms_norm
    assert ops.apply_rotary is triton_rotary.apply_rotary
    assert ops.silu_and_mul is triton_activation.silu_and_mul
    assert ops.rotary_cos_sin is rotary.rotary_cos_sin
    assert ops.store_kv_cache is triton_cache.store_kv_cache
    assert ops.paged_attention is triton_attention.paged_attention
