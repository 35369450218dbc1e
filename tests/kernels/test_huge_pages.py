"""Huge pages under the packed weights and the KV cache (kernels/cpu/huge_pages.py): asked for before the first
write, so the kernel backs the buffers with 2 MiB pages wherever the system allows it (THP ``always`` or
``madvise``)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from ksana.kernels.cpu import load_library
from ksana.kernels.cpu.huge_pages import HUGE_PAGE, huge_page_empty, huge_page_zeros
from ksana.kernels.cpu.ops import NativeCPUOps
from ksana.kernels.cpu.packed import PackedWeight, dense_weight
from ksana.models.shape import ModelShape
from ksana.worker.kv_cache import KVCache

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


def test_a_buffer_of_a_huge_page_or_more_gets_huge_pages_and_holds_its_data() -> None:
    buffer = huge_page_empty((6 * HUGE_PAGE + 12345,), torch.uint8)
    pattern = (torch.arange(buffer.numel()) % 251).to(torch.uint8)
    buffer.copy_(pattern)
    assert torch.equal(buffer, pattern)
    _expect_huge(buffer)
    bf16 = huge_page_empty((1024, 2048), torch.bfloat16)
    assert bf16.shape == (1024, 2048) and bf16.dtype == torch.bfloat16 and bf16.is_contiguous()
    small = huge_page_empty((100,), torch.float32)  # below one huge page: an ordinary allocation
    assert small.shape == (100,)


def test_zeros_are_zeros_below_and_above_one_huge_page() -> None:
    for shape in ((3, 5), (1024, 1024)):  # an ordinary allocation, then a mapping of its own
        zeros = huge_page_zeros(shape, torch.float32, "cpu")
        assert zeros.shape == shape and not zeros.any()


def test_pack_weights_asks_for_huge_pages_before_packing() -> None:
    library = load_library()
    if library is None or not NativeCPUOps(library).has_linear:
        pytest.skip("no packed weights on this CPU (they need the native kernels on AVX2 or AVX-512)")
    weight = torch.randn(1024, 2048)  # 8 MiB of float32
    packed = NativeCPUOps(library).pack_weight(weight)
    assert isinstance(packed, PackedWeight)
    assert torch.equal(dense_weight(packed), weight)
    _expect_huge(packed.packed)


def test_the_kv_cache_is_zero_filled_on_huge_pages() -> None:
    shape = ModelShape(model_type="llama", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32,
                       intermediate_size=256, vocab_size=100, max_position_embeddings=64,
                       sliding_windows=[None, None], eos_token_ids=[], dtype=torch.float32)
    for head_major in (True, False):
        cache = KVCache.allocate(shape, num_blocks=1024, block_size=16, dtype=torch.float32, device="cpu",
                                 head_major=head_major)  # 4 MiB a tensor
        for k, v in cache.layers:
            assert k.shape == v.shape == (1024, 16, 2, 32)
            assert not k.any() and not v.any()
            _expect_huge(k)
            _expect_huge(v)
