"""The Ascend path without Ascend: ``kernels.npu`` imports and falls back to the reference without torch_npu,
and its fused branch passes arguments the way torch-npu's documented operators take them (checked against a
fake ``torch_npu`` that implements those documented semantics on CPU)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from ksana.kernels import activation, attention, norm, npu, rotary
from ksana.kernels.backends import npu_ops


def test_cpu_and_npu_paths_never_import_triton():
    code = (
        "import sys; from ksana.kernels import backends, dispatch, npu; backends.npu_ops(); "
        "dispatch.get_ops('cpu'); assert 'triton' not in sys.modules, 'triton imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "TRITON_INTERPRET": "0"})


def test_imports_and_falls_back_without_torch_npu():
    if npu.torch_npu is None:  # the case on every CI machine
        assert not npu.is_npu_available()
        assert npu_ops().name == "npu-reference"
    x, residual, weight = torch.randn(3, 40), torch.randn(3, 40), torch.randn(40)
    assert torch.equal(npu.rms_norm(x, weight, 1e-6), norm.rms_norm(x, weight, 1e-6))
    torch.testing.assert_close(
        npu.fused_add_rms_norm(x, residual, weight, 1e-6),
        norm.fused_add_rms_norm(x, residual, weight, 1e-6),
        rtol=0,
        atol=0,
    )
    cos, sin = torch.randn(3, 8), torch.randn(3, 8)
    heads = torch.randn(3, 5, 8)
    for is_neox in (True, False):
        assert torch.equal(
            npu.apply_rotary(heads, cos, sin, is_neox), rotary.apply_rotary(heads, cos, sin, is_neox)
        )
    assert torch.equal(npu.silu_and_mul(x), activation.silu_and_mul(x))
    ops = npu_ops()
    assert ops.rms_norm is npu.rms_norm and ops.paged_attention is attention.paged_attention
    assert ops.store_kv_cache is attention.store_kv_cache


@pytest.mark.parametrize("failure", ["missing", "broken"])
def test_guarded_import(failure, tmp_path, monkeypatch):
    """A missing torch_npu and one raising on import (a bad CANN install) both leave the reference path."""
    with monkeypatch.context() as patch:
        if failure == "missing":
            patch.setitem(sys.modules, "torch_npu", None)  # makes `import torch_npu` raise ImportError
        else:
            (tmp_path / "torch_npu.py").write_text(
                "raise RuntimeError('libascendcl.so: cannot open shared object')\n"
            )
            patch.syspath_prepend(str(tmp_path))
            patch.delitem(sys.modules, "torch_npu", raising=False)
        module = importlib.reload(npu)
        assert module.torch_npu is None and not module.is_npu_available()
    importlib.reload(npu)


class FakeTorchNpu(types.ModuleType):
    """torch-npu's fused operators as their documentation defines them, with its shape rules asserted."""

    def __init__(self, has_rotary_mode: bool = True):
        super().__init__("torch_npu")
        self.has_rotary_mode = has_rotary_mode
        self.calls: list[str] = []

    @staticmethod
    def _rms(x, gamma, epsilon):
        x32 = x.float()
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + epsilon)
        return (x32 * rstd * gamma.float()).to(x.dtype), rstd

    def npu_rms_norm(self, x, gamma, epsilon=1e-6):
        self.calls.append("npu_rms_norm")
        return self._rms(x, gamma, epsilon)

    def npu_add_rms_norm(self, x1, x2, gamma, epsilon=1e-6):
        self.calls.append("npu_add_rms_norm")
        summed = x1 + x2
        return (*self._rms(summed, gamma, epsilon), summed)

    def npu_rotary_mul(self, x, r1, r2, **kwargs):
        if kwargs and not self.has_rotary_mode:
            raise TypeError("npu_rotary_mul() got an unexpected keyword argument 'rotary_mode'")
        mode = kwargs.pop("rotary_mode", "half")
        assert not kwargs and x.dim() == r1.dim() == r2.dim() == 4, "npu_rotary_mul takes 4-D tensors"
        assert r1.shape[0] == r1.shape[2] == 1 and r1.shape[1] == x.shape[1], "cos/sin as 1S1D for BSND"
        self.calls.append(f"npu_rotary_mul:{mode}")
        if mode == "half":
            x1, x2 = x.chunk(2, dim=-1)
            rotated = torch.cat((-x2, x1), dim=-1)
        else:
            rotated = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
        return r1 * x + r2 * rotated

    def npu_swiglu(self, x, dim=-1):
        assert x.is_contiguous(), "npu_swiglu rejects non-contiguous tensors"
        self.calls.append("npu_swiglu")
        a, b = x.chunk(2, dim=dim)
        return F.silu(a) * b


@pytest.fixture
def fake_npu(monkeypatch):
    fake = FakeTorchNpu()
    monkeypatch.setattr(npu, "torch_npu", fake)
    monkeypatch.setattr(npu, "_fused", lambda *tensors: True)  # CPU tensors stand in for NPU ones
    monkeypatch.setattr(npu, "_interleave_unsupported", False)
    return fake


def test_fused_branch_matches_reference(fake_npu):
    x, residual, weight = torch.randn(4, 48), torch.randn(4, 48), torch.randn(48)
    torch.testing.assert_close(npu.rms_norm(x, weight, 1e-5), norm.rms_norm(x, weight, 1e-5))
    torch.testing.assert_close(
        npu.fused_add_rms_norm(x, residual, weight, 1e-5), norm.fused_add_rms_norm(x, residual, weight, 1e-5)
    )
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float) / 16))
    qk = torch.randn(5, 9, 16)
    for is_neox in (True, False):
        cos, sin = rotary.rotary_cos_sin(torch.arange(5) * 3, inv_freq, 1.0, torch.float32, is_neox)
        torch.testing.assert_close(
            npu.apply_rotary(qk, cos, sin, is_neox), rotary.apply_rotary(qk, cos, sin, is_neox)
        )
    gate_up = torch.randn(6, 2 * 48)[:, :]
    torch.testing.assert_close(
        npu.silu_and_mul(gate_up.t().contiguous().t()), activation.silu_and_mul(gate_up)
    )
    assert fake_npu.calls == [
        "npu_rms_norm",
        "npu_add_rms_norm",
        "npu_rotary_mul:half",
        "npu_rotary_mul:interleave",
        "npu_swiglu",
    ]


def test_old_torch_npu_without_interleave_keeps_gptj_on_reference(fake_npu):
    fake_npu.has_rotary_mode = False
    qk, cos, sin = torch.randn(3, 2, 8), torch.randn(3, 8), torch.randn(3, 8)
    for _ in range(2):
        torch.testing.assert_close(
            npu.apply_rotary(qk, cos, sin, False), rotary.apply_rotary(qk, cos, sin, False)
        )
    assert npu._interleave_unsupported and fake_npu.calls == []  # tried once, then never again


def test_mixed_dtypes_stay_on_reference(fake_npu):
    x, weight = torch.randn(2, 8).to(torch.bfloat16), torch.randn(8)
    assert torch.equal(npu.rms_norm(x, weight, 1e-6), norm.rms_norm(x, weight, 1e-6))
    assert fake_npu.calls == []
