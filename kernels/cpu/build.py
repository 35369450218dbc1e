"""Build the CPU kernels into one library of typed torch operators, once per source and CPU, and load it.

The kernels (C++ with OpenMP over ``vec.h``'s lanes, one file per operator family) compile per instruction-set
level; ``registration.cpp`` declares them as torch operators (``torch.ops.ksana.*``: schemas, checks at the call,
profiler names) and compiles once for every level, against torch's headers from ``torch.utils.cpp_extension``. Both
link into one shared library, which ``torch.ops.load_library`` loads: built on first use (JIT), not at install.
Builds are cached under ``$KSANA_CACHE_DIR`` (built in a temporary directory and renamed into place, so racing
processes such as tensor-parallel ranks build once), keyed by the sources, the flags, the compiler and torch's
version, so an edit or another machine's CPU gets its own build. Without a C++ compiler, or when the build fails,
``load_library`` returns None and the CPU runs the torch reference ops.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

HERE = Path(__file__).parent
# Older revisions of this folder, which the A/B tools build, kept the packed linear and the fused decode step in
# one C file; a folder that has it gets it compiled as C.
C_SOURCE_NAME = "ksana_cpu.c"
REGISTRATION = HERE / "registration.cpp"


def cxx_sources(kernels: Path = HERE) -> tuple[Path, ...]:
    """The kernels in C++ over vec.h's lanes, one file per operator family: every ``.cpp`` of the folder but the
    registration."""
    return tuple(sorted(path for path in kernels.glob("*.cpp") if path.name != REGISTRATION.name))


def headers(kernels: Path = HERE) -> tuple[Path, ...]:
    return tuple(sorted(kernels.glob("*.h")))


CXX_SOURCES = cxx_sources()
LIBRARY_NAME = "libksana_cpu.so"
NAMESPACE = "ksana"  # torch.ops.ksana; the A/B tools load other builds under other names
# "torch" forces the reference ops (to compare paths, or if the native build misbehaves); a level from LEVELS builds
# for at most that instruction set (so the other CPUs' paths can be tested here): "portable" is vec.h's portable
# lanes, "avx2" adds AVX2/FMA (with the packed linear and fused decode), "avx512" the 16-lane kernels and the
# packed linear's wide schedule with its fused greedy sampling.
CPU_KERNELS_ENV = "KSANA_CPU_KERNELS"
# "1" builds the C++ kernels' 16-lane (AVX-512) code on lanes of two F32x8, so that it runs, and is tested, on a
# CPU without AVX-512 (tests/kernels/test_cpu_native.py).
WIDE_LANES_ENV = "KSANA_CPU_WIDE_LANES"
DTYPES = (torch.float32, torch.bfloat16)  # what the kernels take


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


def compiler_flags(level: str | None = None) -> list[str]:
    """-O3, plus per level (``build_level()`` unless given): AVX2/FMA; AVX-512 (``-DKSANA_AVX512``, which
    ``cxx_flags`` turns into the AVX-512 targets: vec.h's F32x16 is then __m512). Never -ffast-math, and no FMA
    contraction of elementwise code, so rounding matches torch's eager ops (attention and linear use FMA
    explicitly).

    bfloat16 linears widen to float32 and FMA rather than use AVX512_BF16's ``vdpbf16ps``, which ran slower from
    16 rows on Intel's AVX-512 Xeons."""
    flags = ["-O3", "-fPIC", "-fopenmp", "-ffp-contract=off", f"-I{HERE}"]
    index = LEVELS.index(level or build_level())
    if index >= LEVELS.index("avx2"):
        flags += ["-mavx2", "-mfma", "-mf16c"]
    if index >= LEVELS.index("avx512"):
        flags.append("-DKSANA_AVX512")
    return flags


def find_compiler() -> str | None:
    """``$CC``, else ``cc`` or ``gcc`` on the PATH; None when there is none. Only an older revision's C file (see
    ``C_SOURCE_NAME``) needs it."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    return compiler if compiler and shutil.which(compiler) else None


def find_cxx_compiler() -> str | None:
    """``$CXX``, else ``c++`` or ``g++`` on the PATH; None when there is none."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    return compiler if compiler and shutil.which(compiler) else None


def registration_flags() -> list[str]:
    """What ``registration.cpp`` compiles with: torch's headers and C++ ABI."""
    from torch.utils.cpp_extension import include_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return ["-O2", "-fPIC", "-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *(f"-I{path}" for path in include_paths())]


def _version(compiler: str) -> str:
    return subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout


def build_key(*parts: str | bytes) -> str:
    """A cache key over ``parts`` and torch's version (the registration is compiled against its headers)."""
    digest = hashlib.sha256(torch.__version__.encode())
    for part in parts:
        digest.update(b"\0" + (part if isinstance(part, bytes) else part.encode()))
    return digest.hexdigest()[:16]


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr}")


def compile_registration(cxx: str, directory: Path) -> Path:
    """``registration.cpp`` compiled into ``directory``: the object file's path."""
    output = directory / "registration.o"
    _run([cxx, *registration_flags(), "-c", "-o", str(output), str(REGISTRATION)])
    return output


def registration_object(cxx: str) -> Path:
    """The registration's object file from the cache, compiled the first time (about half a minute: torch's
    headers), then shared by every level's build and every namespace."""
    from ..build_cache import build_cached

    key = build_key(REGISTRATION.read_bytes(), cxx, _version(cxx), *registration_flags())
    return build_cached(f"cpu-ops-registration-{key}", lambda tmp: compile_registration(cxx, tmp)) / (
        "registration.o")


def cxx_flags(flags: list[str]) -> list[str]:
    """The kernels' C++ flags from ``compiler_flags``: an AVX-512 build compiles for AVX-512 throughout (vec.h's
    F32x16 is then __m512), keeping the compiler's own vectorisation 256 bits wide."""
    cxx = [*flags, "-std=c++20"]
    if "-DKSANA_AVX512" in flags:
        cxx += ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mprefer-vector-width=256"]
    if os.environ.get(WIDE_LANES_ENV) == "1":
        cxx.append("-DKSANA_WIDE_LANES")
    return cxx


def compile_library(flags: list[str], directory: Path, kernels: Path = HERE) -> Path:
    """The kernels in ``kernels`` (this folder, or a copy of another revision's: the A/B tools') compiled with
    ``flags``, linked with the registration into ``directory``: the shared library's path. RuntimeError with the
    compiler's output when a step fails."""
    from torch.utils.cpp_extension import library_paths

    cxx = find_cxx_compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX, or put c++ or g++ on the PATH)")
    registration = registration_object(cxx)
    flags = [f"-I{kernels}" if flag == f"-I{HERE}" else flag for flag in flags]
    commands = []
    if (kernels / C_SOURCE_NAME).exists():
        compiler = find_compiler()
        if compiler is None:
            raise RuntimeError(f"no C compiler found for {kernels / C_SOURCE_NAME} (set CC)")
        commands.append([compiler, *flags, "-std=c11", "-c", "-o", str(directory / "ksana_cpu.o"),
                         str(kernels / C_SOURCE_NAME)])
    for cxx_source in cxx_sources(kernels):
        commands.append([cxx, *cxx_flags(flags), "-c", "-o", str(directory / f"{cxx_source.stem}.o"),
                         str(cxx_source)])
    objects = [Path(command[-2]) for command in commands]
    # One compiler a core: the files are independent, and at -O3 some take 10-20 s each (the wide schedule's).
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(_run, commands))
    output = directory / LIBRARY_NAME
    torch_libs = [f"-L{path}" for path in library_paths()] + [f"-Wl,-rpath,{path}" for path in library_paths()]
    _run([cxx, "-shared", "-fopenmp", "-o", str(output), str(registration), *map(str, objects), *torch_libs,
          "-lc10", "-ltorch_cpu", "-lm"])
    return output


def cached_library(cxx: str, flags: list[str], kernels: Path = HERE, announce: bool = False) -> Path:
    """The shared library of the kernels in ``kernels`` compiled with ``flags``, from Ksana's build cache (compiled
    the first time, saying so where ``announce``): keyed by the sources, the registration, the compiler and every
    flag, so the engine and the A/B tools (``tools/_sources.py``) share one build of the same sources."""
    from ..build_cache import build_cached

    def compile_into(directory: Path) -> None:
        if announce:
            print(f"building {kernels}", flush=True)
        compile_library(flags, directory, kernels)

    key = build_key(sources_digest(kernels), REGISTRATION.read_bytes(), cxx, _version(cxx), *cxx_flags(flags),
                    *registration_flags())
    return build_cached(f"cpu-kernels-{key}", compile_into) / LIBRARY_NAME


def sources_digest(kernels: Path = HERE) -> bytes:
    """The kernels' own sources in ``kernels``, for the cache key (the C++ families, their headers, an older
    revision's C file)."""
    paths = (*cxx_sources(kernels), *headers(kernels), *kernels.glob(C_SOURCE_NAME))
    return b"\0".join(path.name.encode() + b"\0" + path.read_bytes() for path in paths)


def load_ops(path: Path, namespace: str = NAMESPACE):
    """The operators of the library at ``path`` under ``torch.ops.<namespace>``, with their fake implementations.
    A namespace registers once a process (a second library under the same name would abort it), so a namespace
    already loaded gives its operators as they are."""
    from .fakes import register_fakes

    if namespace not in _loaded_namespaces:
        previous = os.environ.get(NAMESPACE_ENV)
        os.environ[NAMESPACE_ENV] = namespace  # registration.cpp reads it as the library loads
        try:
            torch.ops.load_library(str(path))
        finally:
            if previous is None:
                del os.environ[NAMESPACE_ENV]
            else:
                os.environ[NAMESPACE_ENV] = previous
        _loaded_namespaces[namespace] = path
        register_fakes(namespace)
    return getattr(torch.ops, namespace)


NAMESPACE_ENV = "KSANA_OPS_NAMESPACE"
_loaded_namespaces: dict[str, Path] = {}


@functools.cache
def load_library():
    """``torch.ops.ksana``, the compiled kernels' operators, or None (no compiler, a failed build, or
    ``KSANA_CPU_KERNELS=torch``); the reason is logged once, as a warning where the native kernels were wanted."""
    if os.environ.get(CPU_KERNELS_ENV, "native") == "torch":
        return None
    cxx = find_cxx_compiler()
    if cxx is None:
        logger.warning("no C++ compiler found (set CXX, or put c++ or g++ on the PATH): the CPU runs the slower torch "
                       "reference ops")
        return None
    try:
        return load_ops(cached_library(cxx, compiler_flags()))
    except (OSError, RuntimeError) as error:
        logger.warning("native CPU kernels unavailable, using torch reference ops: %s", error)
        return None
