"""Kernel sources and builds for the A/B tools (``decode_ab.py``, ``attention_ab.py``, ``decode_phases.py``):
HEAD's source, so a working tree's change can be set against what is committed without a second checkout, and any
source compiled on its own, with extra ``-D`` defines (``KSANA_PHASE_CLOCK`` for ``decode_phases.py``).

A source must export every kernel the current ``kernels/cpu/build.py`` binds: the tools compare revisions of the
kernels' code, not of their interface.
"""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
from pathlib import Path

from ksana.kernels.build_cache import build_cached
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
    """``source`` compiled with this machine's flags plus ``-D`` each of ``defines``, loaded and bound. Builds are
    cached by content (source, compiler, flags) in Ksana's cache, so the same source is compiled once; the copy
    loaded is placed in ``directory`` (a fresh folder), so two builds of one source are still two libraries."""
    compiler = build.find_compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found (set CC, or put cc or gcc on the PATH)")
    flags = [*build.compiler_flags(), *(f"-D{name}" for name in defines)]
    key = hashlib.sha256("\0".join([source.read_text(), compiler, *flags]).encode()).hexdigest()[:16]

    def compile_into(tmp: Path) -> None:
        print(f"building {source}", flush=True)
        build.compile_library(compiler, flags, tmp, source)

    cached = build_cached(f"tool-build-{key}", compile_into) / build.LIBRARY_NAME
    directory.mkdir()
    library = directory / build.LIBRARY_NAME
    shutil.copyfile(cached, library)
    return build.bind(ctypes.CDLL(str(library)))


def build_ops(source: Path, directory: Path) -> NativeCPUOps:
    """``NativeCPUOps`` over ``build_library(source, directory)``."""
    return NativeCPUOps(build_library(source, directory))
