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
# Argument types of each kernel (same for the _f32 and _bf16 variants).
SIGNATURES: dict[str, tuple] = {
    "rms_norm": (_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _f32, _int),
    "rotary_neox": (_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _int),
    "silu_and_mul": (_ptr, _i64, _ptr, _i64, _i64, _int),
    "store_kv": (_ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64),
    "paged_decode": (_ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _i64, _f32,
                     _i64, _int),
    "pack_weight": (_ptr, _i64, _i64, _ptr, _int),
    "packed_linear": (_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _int),
    "decode_layers": (_ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64,
                      _ptr, _i64, _i64, _i64, _f32, _f32, _int, _ptr),
    "packed_linear_greedy": (_ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _int),
}
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

    bfloat16 linears widen to float32 and FMA rather than use AVX512_BF16's ``vdpbf16ps``: on this VM's Xeon the
    dot-product version measured 16-23% slower from 16 rows (a scratch A/B of both builds in one process; that was
    against the earlier dot-product tiles over torch's layout, not re-measured on the packed panels)."""
    flags = ["-O3", "-fPIC", "-shared", "-fopenmp", "-std=c11", "-ffp-contract=off"]
    level = LEVELS.index(build_level())
    if level >= LEVELS.index("avx2"):
        flags += ["-mavx2", "-mfma", "-mf16c"]
    if level >= LEVELS.index("avx512"):
        flags.append("-DKSANA_AVX512")
    return flags


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build_key(compiler: str, flags: list[str]) -> str:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(" ".join([compiler, version, *flags]).encode())
    return digest.hexdigest()[:16]


def _compile(compiler: str, flags: list[str], directory: Path, source: Path = SOURCE) -> None:
    cmd = [compiler, *flags, "-o", str(directory / LIBRARY_NAME), str(source), "-lm"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr}")


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The compiled kernels with their argument types set, or None (no compiler, a failed build, or
    ``KSANA_CPU_KERNELS=torch``); the reason is logged once."""
    if os.environ.get(CPU_KERNELS_ENV, "native") == "torch":
        return None
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C compiler found: CPU runs the (slower) torch reference ops")
        return None
    from ..build_cache import build_cached

    flags = compiler_flags()
    try:
        directory = build_cached(f"cpu-kernels-{_build_key(compiler, flags)}",
                                 lambda tmp: _compile(compiler, flags, tmp))
        library = ctypes.CDLL(str(directory / LIBRARY_NAME))
    except (OSError, RuntimeError) as error:
        logger.warning("native CPU kernels unavailable, using torch reference ops: %s", error)
        return None
    return _bind(library)


def build_library(source: Path, directory: Path, defines: tuple[str, ...] = ()) -> ctypes.CDLL:
    """Another source of the kernels (an older revision, an experiment) compiled with this machine's flags, plus
    ``-D`` each of ``defines``, into ``directory``, uncached, and loaded: ``bench/decode_ab.py`` runs two builds in
    one engine, ``bench/decode_phases.py`` the build with ``KSANA_PHASE_CLOCK``."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found")
    _compile(compiler, [*compiler_flags(), *(f"-D{name}" for name in defines)], directory, source)
    return _bind(ctypes.CDLL(str(directory / LIBRARY_NAME)))


def _bind(library: ctypes.CDLL) -> ctypes.CDLL:
    """The argument and return types of every kernel, so ctypes passes int64 and float arguments as such."""
    for name, argtypes in SIGNATURES.items():
        for suffix in DTYPE_SUFFIX.values():
            fn = getattr(library, f"{name}_{suffix}")
            fn.argtypes, fn.restype = argtypes, None
    library.linear_available.argtypes, library.linear_available.restype = (), _int
    if hasattr(library, "set_packed_prefetch_min_rows"):  # not in older sources that decode_ab.py may build
        library.set_packed_prefetch_min_rows.argtypes = (_int,)
        library.set_packed_prefetch_min_rows.restype = _int
    library.greedy_logprobs.argtypes = (_ptr, _i64, _i64, _ptr, _ptr, _int)  # float32 logits only
    library.greedy_logprobs.restype = None
    if hasattr(library, "unpack_weight_f32"):  # AVX2 and AVX-512 builds of current sources only
        for suffix in DTYPE_SUFFIX.values():
            fn = getattr(library, f"unpack_weight_{suffix}")
            fn.argtypes, fn.restype = (_ptr, _i64, _i64, _ptr, _int), None
    if hasattr(library, "packed_rows_f32"):  # the same builds, from session 37's sources on
        for suffix in DTYPE_SUFFIX.values():
            fn = getattr(library, f"packed_rows_{suffix}")
            fn.argtypes, fn.restype = (_ptr, _i64, _i64, _ptr, _i64, _ptr), _int
    if hasattr(library, "prefill_attention_f32"):  # not in older sources that decode_ab.py may build
        library.prefill_attention_available.argtypes, library.prefill_attention_available.restype = (), _int
        library.prefill_attention_f32.argtypes = (_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64,
                                                  _i64, _i64, _f32, _i64, _ptr, _int)  # float32 only
        library.prefill_attention_f32.restype = None
    return library
