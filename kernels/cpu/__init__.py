"""Native CPU kernels (C++ over one vector abstraction, and C, with OpenMP; typed torch operators) for the
decoder's ops, and on AVX2 and AVX-512 its matmuls.

On a small CPU the eager torch reference spends most of a decode step outside the matmuls: dozens of tiny ops
per layer, each paying dispatch and a thread-pool wake-up, and decode attention that copies every sequence's
cached K/V out of its blocks before SDPA reads it again. These kernels do each op in one call, and decode
attention reads K/V in place through the block tables, once. At decode's few rows BLAS streams the weights at a
fraction of the CPU's read bandwidth (bench/kernel_ops.py sets the kernels against torch), so on AVX2 and
AVX-512 CPUs the loader packs every projection's weights into 16-column panels (``kernels/cpu/packed.py``) that one
native matmul streams once at decode sizes and tiles for prefill, and a decode step's layers run in one native
call, one OpenMP region (no Python and no fork between the ops). Float32 prefill attention is native there too:
SDPA's CPU kernel runs a prompt's small per-chunk matrix products through MKL far below the FMA peak. On CPUs
with AMX, bfloat16 projections of 32 rows or more (prefill) leave the native matmul for oneDNN's AMX tiles, from
the panels unpacked (``NativeCPUOps.linear``). Other CPUs keep torch's layout, BLAS and SDPA.
"""

from __future__ import annotations

from .build import load_library

__all__ = ["load_library"]
