"""BlockAllocator: the pool of KV block ids; only the cache manager calls it."""

from __future__ import annotations

from collections import deque


class BlockAllocatorError(RuntimeError):
    """A block was freed twice or never allocated: a bookkeeping bug, never a user error."""


class BlockAllocator:
    """A free list of ``num_blocks`` ids; allocation is all-or-nothing so a refusal leaves nothing half-done."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._is_used = bytearray(num_blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, num: int) -> bool:
        return num <= len(self._free)

    def allocate(self, num: int) -> list[int]:
        if num > len(self._free):
            raise BlockAllocatorError(f"asked for {num} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(num)]
        for block in blocks:
            self._is_used[block] = 1
        return blocks

    def free(self, blocks: list[int]) -> None:
        for block in blocks:
            if not self._is_used[block]:
                raise BlockAllocatorError(f"block {block} freed but not in use")
            self._is_used[block] = 0
            self._free.append(block)
