"""Kernel sources and builds for the A/B tools (``decode_ab.py``, ``attention_ab.py``, ``decode_phases.py``):
HEAD's source, so a working tree's change can be set against what is committed without a second checkout, and any
source compiled on its own, with extra ``-D`` defines (``KSANA_PHASE_CLOCK`` for ``decode_phases.py``).

A source must export every kernel the current ``kernels/cpu/build.py`` binds: the tools compare revisions of the
kernels' code, not of their interface.
"""

from __future__ import annotations

import ctypes
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


def build_library(source: Path, directory: Path, defines: tuple[str, ...] = ()) -> ctypes.CDLL:
    """``source`` compiled with this machine's flags plus ``-D`` each of ``defines`` into ``directory`` (made
    here: a fresh folder), uncached, loaded and bound."""
    compiler = build.find_compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found (set CC, or put cc or gcc on the PATH)")
    directory.mkdir()
    print(f"building {source}", flush=True)
    flags = [*build.compiler_flags(), *(f"-D{name}" for name in defines)]
    return build.bind(ctypes.CDLL(str(build.compile_library(compiler, flags, directory, source))))


def build_ops(source: Path, directory: Path) -> NativeCPUOps:
    """``NativeCPUOps`` over ``build_library(source, directory)``."""
    return NativeCPUOps(build_library(source, directory))
