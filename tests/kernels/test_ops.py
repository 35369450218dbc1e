"""RMSNorm, rotary and SiLU-and-mul against the ``transformers`` Llama code they must reproduce bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from ksana.kernels import apply_rotary, fused_add_rms_norm, get_ops, rms_norm, rotary_cos_sin, silu_and_mul
from ksana.kernels.cpu import load_library
from ksana.kernels.dispatch import TORCH_OPS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_equals_hf(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    hf = LlamaRMSNorm(48, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(48))
    x = (torch.randn(7, 48) * 3).to(dtype)
    residual = torch.randn(7, 48).to(dtype)
    with torch.no_grad():
        assert torch.equal(rms_norm(x, hf.weight, 1e-5), hf(x))
        normed, new_residual = fused_add_rms_norm(x, residual, hf.weight, 1e-5)
        assert torch.equal(new_residual, residual + x)
        assert torch.equal(normed, hf(residual + x))
    assert rms_norm(x, hf.weight, 1e-5).dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_neox_equals_hf(dtype: torch.dtype) -> None:
    head_dim, positions = 16, torch.tensor([0, 5, 1, 300, 17])
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    q = torch.randn(5, 6, head_dim).to(dtype)
    k = torch.randn(5, 2, head_dim).to(dtype)
    cos, sin = rotary_cos_sin(positions, inv_freq, 1.0, dtype)
    # HF: cos/sin [batch, seq, dim], q/k [batch, heads, seq, dim].
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    both = apply_rotary(torch.cat([q, k], dim=1), cos, sin)
    assert torch.equal(both[:, :6], hf_q[0].transpose(0, 1))
    assert torch.equal(both[:, 6:], hf_k[0].transpose(0, 1))


def test_rotary_gptj_rotates_adjacent_pairs() -> None:
    head_dim, positions = 8, torch.arange(4) * 7
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    x = torch.randn(4, 3, head_dim)
    cos, sin = rotary_cos_sin(positions, inv_freq, 1.0, torch.float32, is_neox=False)
    out = apply_rotary(x, cos, sin, is_neox=False)
    pairs = torch.view_as_complex(x.view(4, 3, head_dim // 2, 2).contiguous())
    angles = positions[:, None].float() * inv_freq[None]
    expected = torch.view_as_real(pairs * torch.polar(torch.ones_like(angles), angles)[:, None]).flatten(-2)
    torch.testing.assert_close(out, expected)


def test_silu_and_mul() -> None:
    gate, up = torch.randn(5, 24), torch.randn(5, 24)
    torch.testing.assert_close(silu_and_mul(torch.cat([gate, up], dim=-1)), F.silu(gate) * up)


def test_dispatch_maps_cpu_to_native_and_cuda_to_triton() -> None:
    assert get_ops("cpu").name == ("torch" if load_library() is None else "cpu-native")  # torch: no C compiler
    assert get_ops(torch.device("cuda", 1)).name == "triton"
    assert TORCH_OPS.rms_norm is rms_norm
