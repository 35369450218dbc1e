"""Kernel sources and builds for the A/B tools (``decode_ab.py``, ``attention_ab.py``, ``decode_phases.py``):
HEAD's source, so a working tree's change can be set against what is committed without a second checkout, and any
source compiled on its own, with extra ``-D`` defines (``KSANA_PHASE_CLOCK`` for ``decode_phases.py``).

A source must define every kernel the current ``kernels/cpu/registration.cpp`` declares: the tools compare
revisions of the kernels' code, not of their interface.
"""

from __future__ import annotations

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


def build_library(source: Path, directory: Path, defines: tuple[str, ...] = ()):
    """``source`` (a revision of ``ksana_cpu.c``; the C++ kernels are the working tree's) compiled with this
    machine's flags plus ``-D`` each of ``defines`` and loaded: its operators, under a namespace of their own
    (``torch.ops.ksana_<key>_<directory name>``), so that they sit beside the engine's. Builds are cached by
    content (sources, compiler, flags) in Ksana's cache, so the same source is compiled once; the copy loaded is
    placed in ``directory`` (a fresh folder), so two builds of one source are still two libraries."""
    compiler = build.find_compiler()
    if compiler is None or build.find_cxx_compiler() is None:
        raise RuntimeError("no C or C++ compiler found (set CC and CXX, or put cc and c++ on the PATH)")
    flags = [*build.compiler_flags(), *(f"-D{name}" for name in defines)]
    others = b"".join(path.read_bytes() for path in (*build.CXX_SOURCES, *build.HEADERS, build.REGISTRATION))
    key = hashlib.sha256("\0".join([source.read_text(), compiler, *flags]).encode() + others).hexdigest()[:16]

    def compile_into(tmp: Path) -> None:
        print(f"building {source}", flush=True)
        build.compile_library(compiler, flags, tmp, source)

    cached = build_cached(f"tool-build-{key}", compile_into) / build.LIBRARY_NAME
    directory.mkdir()
    library = directory / build.LIBRARY_NAME
    shutil.copyfile(cached, library)
    return build.load_ops(library, f"ksana_{key}_{_identifier(directory.name)}")


def _identifier(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


def build_ops(source: Path, directory: Path) -> NativeCPUOps:
    """``NativeCPUOps`` over ``build_library(source, directory)``."""
    return NativeCPUOps(build_library(source, directory))
