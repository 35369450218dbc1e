"""Kernel sources for the A/B tools (``decode_ab.py``, ``attention_ab.py``): HEAD's, so a working tree's change can be
set against what is committed without a second checkout."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def head_source(directory: Path) -> Path:
    """``kernels/cpu/ksana_cpu.c`` as committed at HEAD, written into ``directory``."""
    text = subprocess.run(["git", "show", "HEAD:kernels/cpu/ksana_cpu.c"], cwd=REPO, capture_output=True,
                          check=True).stdout
    path = directory / "ksana_cpu_head.c"
    path.write_bytes(text)
    return path
