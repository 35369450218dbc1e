"""Huge pages under the packed weights (kernels/cpu/huge_pages.py): asked for before the first write, so the
kernel backs the buffer with 2 MiB pages wherever the system allows it (THP ``always`` or ``madvise``)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

from kernels.cpu import load_library
from kernels.cpu.huge_pages import HUGE_PAGE, advise_huge_pages
from kernels.cpu.ops import NativeCPUOps
from kernels.cpu.packed import PackedWeight, dense_weight

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    """The bracketed choice of ``always madvise never``; None without THP (or Linux)."""
    if not THP_SETTING.exists():
        return None
    chosen = re.search(r"\[(\w+)\]", THP_SETTING.read_text())
    return chosen.group(1) if chosen else None


def _huge_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the mappings under ``tensor`` that are backed by anonymous huge pages (``/proc/self/smaps``)."""
    low = tensor.data_ptr()
    high = low + tensor.numel() * tensor.element_size()
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if mapping := re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line):
            inside = int(mapping.group(1), 16) < high and int(mapping.group(2), 16) > low
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1]) * 1024
    return total


def _expect_huge(tensor: torch.Tensor) -> None:
    """Huge pages under ``tensor`` exactly where THP can give them; a 4 MiB-plus tensor holds at least one whole
    aligned 2 MiB page."""
    if _thp_mode() in ("always", "madvise"):
        assert _huge_bytes(tensor) >= HUGE_PAGE
    elif sys.platform.startswith("linux"):
        assert _huge_bytes(tensor) == 0  # THP "never": the hint changes nothing


def test_the_aligned_interior_is_advised_and_the_data_untouched() -> None:
    buffer = torch.empty(12 * HUGE_PAGE + 12345, dtype=torch.uint8)
    start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
    advised = advise_huge_pages(buffer)
    whole_pages = (end // HUGE_PAGE - -(-start // HUGE_PAGE)) * HUGE_PAGE
    assert advised == (whole_pages if _thp_mode() is not None else 0)
    buffer.copy_(torch.arange(buffer.numel()) % 251)
    assert torch.equal(buffer, (torch.arange(buffer.numel()) % 251).to(torch.uint8))
    _expect_huge(buffer)
    assert advise_huge_pages(torch.empty(100, dtype=torch.uint8)) == 0  # no whole huge page inside


def test_pack_weights_asks_for_huge_pages_before_packing() -> None:
    native = NativeCPUOps(load_library())
    weight = torch.randn(1024, 2048)  # 8 MiB of float32
    packed = native.pack_weight(weight)
    if not isinstance(packed, PackedWeight):  # no packed matmul on this CPU: the weight stays with BLAS
        assert packed is weight
        return
    assert torch.equal(dense_weight(packed), weight)
    _expect_huge(packed.packed)
