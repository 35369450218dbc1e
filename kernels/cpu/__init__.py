"""Native CPU kernels (C + OpenMP through ctypes) for the ops between the matmuls.

On a small CPU the eager torch reference spends most of a decode step outside the matmuls: dozens of tiny ops
per layer, each paying dispatch and a thread-pool wake-up, and decode attention that copies every sequence's
cached K/V out of its blocks before SDPA reads it again. These kernels do each op in one call, and decode
attention reads K/V in place through the block tables, once. Matmuls stay with torch (MKL/oneDNN).
"""

from __future__ import annotations

from kernels.cpu.build import load_library

__all__ = ["load_library"]
