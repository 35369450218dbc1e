"""Smoke tests of the kernel tools in ``tools/``: each loads its script with ``load_tool``."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import ModuleType

import pytest

from ksana.kernels.cpu import build, load_library
from ksana.kernels.cpu.ops import NativeCPUOps
from tests.bench import load_bench


def load_tool(script: str) -> ModuleType:
    """``tools/<script>.py`` as a module."""
    return load_bench(script, folder="tools")


def require_compiler() -> None:
    """Skip the calling test where the tools cannot build the kernels: they compile sources of their own."""
    if build.find_cxx_compiler() is None:
        pytest.skip("no C++ compiler: the tools build the kernels themselves")


def require_fused_decode() -> None:
    """Skip the calling test where this CPU has no fused decode step (no compiler, or neither AVX2 nor AVX-512)."""
    require_compiler()
    library = load_library()
    if library is None or not NativeCPUOps(library).has_linear:
        pytest.skip("no fused decode step on this CPU: it needs AVX2 or AVX-512")


# The line the tools' bit checks perturb: decode attention's softmax normaliser (attention_decode.cpp).
FINISH_LINE = "float inv = sums[g] > 0.f ? 1.0f / sums[g] : 0.f;"


def changed_kernels(tmp_path: Path) -> Path:
    """A copy of ``kernels/cpu`` whose decode attention divides by 1.001 x its softmax's sum: other bits."""
    kernels = tmp_path / "changed_kernels"
    shutil.copytree(build.HERE, kernels, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    source = kernels / "attention_decode.cpp"
    text = source.read_text()
    assert FINISH_LINE in text
    source.write_text(text.replace(FINISH_LINE, FINISH_LINE.replace("1.0f / sums[g]", "1.001f / sums[g]")))
    return kernels
