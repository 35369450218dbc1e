"""The C++ kernels' vector code builds for ARM from the same source: each C++ kernel file cross-compiles for
aarch64 with zig's clang (the ``ziglang`` wheel, a dev dependency), and ``vec.h`` takes its NEON lanes there."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ksana.kernels.cpu import build

pytest.importorskip("ziglang", reason="the ziglang wheel cross-compiles for aarch64")

TARGET = ["-target", "aarch64-linux-gnu"]


def _compile(args: list[str]) -> subprocess.CompletedProcess:
    # -O0: a check that the source compiles and generates code for aarch64; the optimiser adds seconds, not checks.
    return subprocess.run([sys.executable, "-m", "ziglang", "c++", *TARGET, "-std=c++20", "-O0", "-ffp-contract=off",
                           f"-I{build.HERE}", *args], capture_output=True, text=True, check=False)


@pytest.mark.parametrize("source", build.CXX_SOURCES, ids=lambda path: path.name)
def test_each_cxx_kernel_compiles_for_aarch64(source, tmp_path) -> None:
    done = _compile(["-c", str(source), "-o", str(tmp_path / "kernel.o")])
    assert done.returncode == 0, done.stderr
    header = (tmp_path / "kernel.o").read_bytes()[:20]
    assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == 183  # EM_AARCH64


def test_vec_takes_the_neon_lanes_on_aarch64(tmp_path) -> None:
    probe = tmp_path / "probe.cpp"
    probe.write_text('#include "vec.h"\n#if !KSANA_VEC_NEON\n#error not the NEON lanes\n#endif\n')
    done = _compile(["-c", str(probe), "-o", str(tmp_path / "probe.o")])
    assert done.returncode == 0, done.stderr
