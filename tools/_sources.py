"""Kernel sources and builds for the A/B tools (``decode_ab.py``, ``attention_ab.py``): HEAD's source, so a working
tree's change can be set against what is committed without a second checkout, and any source compiled on its own."""

from __future__ import annotations

import subprocess
from pathlib import Path

from ksana.kernels.cpu import build
from ksana.kernels.cpu.ops import NativeCPUOps

REPO = Path(__file__).resolve().parents[1]


def head_source(directory: Path) -> Path:
    """``kernels/cpu/ksana_cpu.c`` as committed at HEAD, written into ``directory``."""
    text = subprocess.run(["git", "show", "HEAD:kernels/cpu/ksana_cpu.c"], cwd=REPO, capture_output=True,
                          check=True).stdout
    path = directory / "ksana_cpu_head.c"
    path.write_bytes(text)
    return path


def build_ops(source: Path, directory: Path) -> NativeCPUOps:
    """``source`` compiled with this machine's flags into ``directory`` (made here: a fresh folder), uncached."""
    directory.mkdir()
    print(f"building {source}", flush=True)
    return NativeCPUOps(build.build_library(source, directory))
