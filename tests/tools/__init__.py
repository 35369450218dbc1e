"""Smoke tests of the kernel tools in ``tools/``: each loads its script with ``load_tool``."""

from __future__ import annotations

from types import ModuleType

from tests.bench import load_bench


def load_tool(script: str) -> ModuleType:
    """``tools/<script>.py`` as a module."""
    return load_bench(script, folder="tools")
