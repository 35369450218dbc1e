"""Smoke tests of the benchmarks: each loads its script from ``bench/`` with ``load_bench``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def load_bench(script: str, folder: str = "bench") -> ModuleType:
    """``<folder>/<script>.py`` as a module (the scripts of ``bench/`` and ``tools/`` are not packages)."""
    spec = importlib.util.spec_from_file_location(f"{folder}_{script}_under_test", REPO / folder / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # attrs resolves the module's classes through sys.modules
    spec.loader.exec_module(module)
    return module
