"""Transparent huge pages for long-lived buffers the decode step streams (the packed weights).

A batch-16 decode step streams every weight once, 4 KiB page after 4 KiB page; each page is a TLB miss, and on a
VM a page walk goes through two page tables. Backed by 2 MiB pages, the same weights took 0.964 of the fused
layers' time at batch 16, context 128 (0.986 at batch 1; smollm2, float32, an AVX2 EPYC, one process alternating
step by step). Linux hands out huge pages for anonymous memory either always or, as on this project's VMs, only
where the process asked with ``madvise(MADV_HUGEPAGE)``: this asks, before the first write, since pages already
touched stay small until ``khugepaged`` merges them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def advise_huge_pages(tensor: torch.Tensor) -> int:
    """Ask for 2 MiB pages under the whole 2 MiB-aligned pages inside ``tensor``'s bytes (its first and last
    partial ones keep small pages); the bytes advised, 0 where the system cannot (not Linux, THP not built in). A
    hint only: where THP is set to ``never`` the memory stays as it was, and the data is never touched."""
    madvise = _madvise()
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first, last = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
    if madvise is None or tensor.device.type != "cpu" or last <= first:
        return 0
    return last - first if madvise(first, last - first, MADV_HUGEPAGE) == 0 else 0
