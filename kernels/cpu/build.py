"""Compile ``ksana_cpu.c`` once per source and CPU and load it with ctypes.

The shared library is cached under ``$KSANA_CACHE_DIR/cpu-kernels-<key>`` (built in a temporary directory and
renamed into place, so racing processes such as tensor-parallel ranks build it once); the key covers the source,
the flags and the compiler, so an edit or another machine's CPU gets its own build. When no C compiler works,
``load_library`` returns None and the CPU falls back to the torch reference ops.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("ksana_cpu.c")
LIBRARY_NAME = "libksana_cpu.so"
# "torch" forces the reference ops (to compare paths, or if the native build misbehaves); a level from LEVELS builds
# for at most that instruction set (so the other CPUs' paths can be tested here): "portable" is the plain C
# fallback, "avx2" adds AVX2/FMA (with the packed linear and fused decode), "avx512" their AVX-512 versions and
# the 16-lane decode attention and fused greedy sampling.
CPU_KERNELS_ENV = "KSANA_CPU_KERNELS"

_i64, _f32, _int, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p
# Argument types of each kernel that has a _f32 and a _bf16 variant (the same for both); they return nothing, but
# for the ones in INT_RESULTS. Every build exports every name: where its instruction set lacks a kernel, a stub that
# Python never calls (``linear_available`` and ``prefill_attention_available`` say which).
SIGNATURES: dict[str, tuple] = {
    "rms_norm": (_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _f32, _int),
    "rotary_neox": (_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _int),
    "silu_and_mul": (_ptr, _i64, _ptr, _i64, _i64, _int),
    "store_kv": (_ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64),
    "paged_decode": (_ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _i64, _f32,
                     _i64, _int),
    "pack_weight": (_ptr, _i64, _i64, _ptr, _int),
    "unpack_weight": (_ptr, _i64, _i64, _ptr, _int),
    "packed_rows": (_ptr, _i64, _i64, _ptr, _i64, _ptr),
    "packed_linear": (_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _int),
    "decode_layers": (_ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64,
                      _ptr, _i64, _i64, _i64, _f32, _f32, _int, _ptr),
    "packed_linear_greedy": (_ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _int),
}
INT_RESULTS = frozenset({"packed_rows"})
DTYPE_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


LEVELS = ("portable", "avx2", "avx512")


def cpu_level() -> str:
    """The highest of ``LEVELS`` this CPU runs (as torch detects it)."""
    capability = torch.backends.cpu.get_cpu_capability()
    return {"AVX512": "avx512", "AVX2": "avx2"}.get(capability, "portable")


def build_level() -> str:
    """``cpu_level()``, or the lower level ``KSANA_CPU_KERNELS`` asks for."""
    detected, requested = cpu_level(), os.environ.get(CPU_KERNELS_ENV, "native")
    if requested in LEVELS and LEVELS.index(requested) < LEVELS.index(detected):
        return requested
    return detected


def compiler_flags() -> list[str]:
    """-O3, plus per level: AVX2/FMA; the AVX-512 packed-weight linear, decode attention and fused decode
    (compiled for AVX-512 inside their own sections only; an AVX2 build has its own packed linear and fused
    decode). Never -ffast-math, and no FMA contraction of elementwise code, so rounding matches torch's eager ops
    (attention and linear use FMA explicitly).

    bfloat16 linears widen to float32 and FMA rather than use AVX512_BF16's ``vdpbf16ps``, which ran slower from
    16 rows on Intel's AVX-512 Xeons."""
    flags = ["-O3", "-fPIC", "-shared", "-fopenmp", "-std=c11", "-ffp-contract=off"]
    level = LEVELS.index(build_level())
    if level >= LEVELS.index("avx2"):
        flags += ["-mavx2", "-mfma", "-mf16c"]
    if level >= LEVELS.index("avx512"):
        flags.append("-DKSANA_AVX512")
    return flags


def find_compiler() -> str | None:
    """``$CC``, else ``cc`` or ``gcc`` on the PATH; None when there is none."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    return compiler if compiler and shutil.which(compiler) else None


def _build_key(compiler: str, flags: list[str]) -> str:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(" ".join([compiler, version, *flags]).encode())
    return digest.hexdigest()[:16]


def compile_library(compiler: str, flags: list[str], directory: Path, source: Path = SOURCE) -> Path:
    """``source`` compiled with ``flags`` into ``directory``; the shared library's path. RuntimeError with the
    compiler's output when it fails."""
    output = directory / LIBRARY_NAME
    cmd = [compiler, *flags, "-o", str(output), str(source), "-lm"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr}")
    return output


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The compiled kernels with their argument types set, or None (no compiler, a failed build, or
    ``KSANA_CPU_KERNELS=torch``); the reason is logged once, as a warning where the native kernels were wanted."""
    if os.environ.get(CPU_KERNELS_ENV, "native") == "torch":
        return None
    compiler = find_compiler()
    if compiler is None:
        logger.warning("no C compiler found (set CC, or put cc or gcc on the PATH): the CPU runs the slower torch "
                       "reference ops")
        return None
    from ..build_cache import build_cached

    flags = compiler_flags()
    try:
        directory = build_cached(f"cpu-kernels-{_build_key(compiler, flags)}",
                                 lambda tmp: compile_library(compiler, flags, tmp))
        library = ctypes.CDLL(str(directory / LIBRARY_NAME))
    except (OSError, RuntimeError) as error:
        logger.warning("native CPU kernels unavailable, using torch reference ops: %s", error)
        return None
    return bind(library)


def bind(library: ctypes.CDLL) -> ctypes.CDLL:
    """The argument and return types of every kernel, so ctypes passes int64 and float arguments as such."""
    for name, argtypes in SIGNATURES.items():
        for suffix in DTYPE_SUFFIX.values():
            fn = getattr(library, f"{name}_{suffix}")
            fn.argtypes, fn.restype = argtypes, _int if name in INT_RESULTS else None
    for name in ("linear_available", "prefill_attention_available"):
        fn = getattr(library, name)
        fn.argtypes, fn.restype = (), _int
    library.set_packed_prefetch_min_rows.argtypes = (_int,)
    library.set_packed_prefetch_min_rows.restype = _int
    library.greedy_logprobs.argtypes = (_ptr, _i64, _i64, _ptr, _ptr, _int)  # float32 logits only
    library.greedy_logprobs.restype = None
    library.prefill_attention_f32.argtypes = (_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64,
                                              _i64, _i64, _f32, _i64, _ptr, _int)  # float32 only
    library.prefill_attention_f32.restype = None
    return library
