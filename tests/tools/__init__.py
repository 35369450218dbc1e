"""Smoke tests of the kernel tools in ``tools/``: each loads its script with ``load_tool``."""

from __future__ import annotations

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
    if build.find_compiler() is None or build.find_cxx_compiler() is None:
        pytest.skip("no C or C++ compiler: the tools build the kernels themselves")


def require_fused_decode() -> None:
    """Skip the calling test where this CPU has no fused decode step (no compiler, or neither AVX2 nor AVX-512)."""
    require_compiler()
    library = load_library()
    if library is None or not NativeCPUOps(library).has_linear:
        pytest.skip("no fused decode step on this CPU: it needs AVX2 or AVX-512")
