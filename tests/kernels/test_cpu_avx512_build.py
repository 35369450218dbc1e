"""The C++ kernels' AVX-512 build compiles on any x86 machine: each C++ kernel file with the flags an AVX-512 CPU
gets, where vec.h takes its __m512 lanes. (The 16-lane code itself runs here as pairs of eight lanes:
``test_cpu_native.py``'s wide-lanes test.)"""

from __future__ import annotations

import platform
import subprocess

import pytest

from ksana.kernels.cpu import build

if platform.machine().lower() not in ("x86_64", "amd64"):
    pytest.skip("AVX-512 is an x86 instruction set", allow_module_level=True)
CXX = build.find_cxx_compiler()
if CXX is None:
    pytest.skip("no C++ compiler", allow_module_level=True)


def _compile(source, output) -> subprocess.CompletedProcess:
    # -O0 after the build's -O3: code generation still runs (so an intrinsic used outside its target fails),
    # without the optimiser's tens of seconds on the largest files.
    flags = [*build.cxx_flags(build.compiler_flags("avx512")), "-O0"]
    return subprocess.run([CXX, *flags, "-c", str(source), "-o", str(output)], capture_output=True, text=True,
                          check=False)


@pytest.mark.parametrize("source", build.CXX_SOURCES, ids=lambda path: path.name)
def test_each_cxx_kernel_compiles_for_avx512(source, tmp_path) -> None:
    done = _compile(source, tmp_path / "kernel.o")
    assert done.returncode == 0, done.stderr


def test_vec_takes_the_avx512_lanes_there(tmp_path) -> None:
    probe = tmp_path / "probe.cpp"
    probe.write_text('#include "vec.h"\n#if !KSANA_VEC_AVX512\n#error not the AVX-512 lanes\n#endif\n'
                     "static_assert(ksana::Wide::lanes == 16);\n")
    done = _compile(probe, tmp_path / "probe.o")
    assert done.returncode == 0, done.stderr
