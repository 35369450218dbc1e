"""Kernel trees and builds for the A/B tools (``decode_ab.py``, ``attention_ab.py``, ``decode_phases.py``): HEAD's
``kernels/cpu`` folder, so a working tree's change can be set against what is committed without a second checkout,
and any such folder compiled on its own, with extra ``-D`` defines (``KSANA_PHASE_CLOCK`` for
``decode_phases.py``).

A folder must define every kernel the current ``kernels/cpu/registration.cpp`` declares: the tools compare
revisions of the kernels' code, not of their interface.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

from ksana.kernels.cpu import build
from ksana.kernels.cpu.ops import NativeCPUOps

REPO = Path(__file__).resolve().parents[1]
# Flags appended to every build's, where set (for example "-O1", which compiles in a third of -O3's time): the tools'
# tests check what the tools report, not how fast the kernels run.
EXTRA_FLAGS_ENV = "KSANA_TOOLS_CXXFLAGS"


def head_kernels(directory: Path) -> Path:
    """``kernels/cpu`` as committed at HEAD, written into ``directory``: the folder's path."""
    archive = subprocess.run(["git", "archive", "HEAD", "kernels/cpu"], cwd=REPO, capture_output=True,
                             check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(directory, filter="data")
    return directory / "kernels" / "cpu"


def kernels_digest(kernels: Path) -> str:
    """A folder's kernel sources, hashed: two folders with the same sources have the same digest."""
    return hashlib.sha256(build.sources_digest(kernels)).hexdigest()


def build_library(kernels: Path, directory: Path, defines: tuple[str, ...] = ()):
    """The kernels of the folder ``kernels`` (a revision of ``kernels/cpu``) compiled with this machine's flags plus
    ``-D`` each of ``defines`` and loaded: its operators, under a namespace of their own
    (``torch.ops.ksana_<key>_<directory name>``), so that they sit beside the engine's. Builds are cached by
    content (sources, compiler, flags) in Ksana's cache, the engine's own build among them, so the same sources are
    compiled once; the copy loaded is placed in ``directory`` (a fresh folder), so two builds of one folder are
    still two libraries."""
    cxx = build.find_cxx_compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX, or put c++ or g++ on the PATH)")
    flags = [*build.compiler_flags(), *(f"-D{name}" for name in defines), *os.environ.get(EXTRA_FLAGS_ENV, "").split()]
    cached = build.cached_library(cxx, flags, kernels, announce=True)
    key = cached.parent.name.rsplit("-", 1)[-1]
    directory.mkdir()
    library = directory / build.LIBRARY_NAME
    shutil.copyfile(cached, library)
    return build.load_ops(library, f"ksana_{key}_{_identifier(directory.name)}")


def _identifier(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


def build_ops(kernels: Path, directory: Path) -> NativeCPUOps:
    """``NativeCPUOps`` over ``build_library(kernels, directory)``."""
    return NativeCPUOps(build_library(kernels, directory))
