"""SWACacheManager: the sliding-window layers' block pool, with the seed's allocation and eviction rules.

A sliding-window (SWA) layer only reads the last ``W`` tokens, so a request holds SWA blocks for its window only,
and the SWA copy of a cached full-attention (FA) block may be dropped while the FA block stays cached. Each SWA
block that holds the KV of a prefix-tree block is *content fixed* and tied to that FA block id; it is reclaimable
while no request holds it. Allocation takes the idle pool first; only when it is empty does it evict, among the
reclaimable content-fixed blocks, the one with the lowest ``hit_count``, then the lowest ``prefix_fa_block_num``
(fewest FA blocks before it: least recomputation saved). A block whose content is not fixed is never evicted: its
owner is still writing it, or frees it directly.

``set_reclaimable(fa_block_id, False)`` adds a holder and ``set_reclaimable(fa_block_id, True)`` drops one: several
requests may share one cached window, so reclaimability is "no holder left", not a single flag.
"""

from __future__ import annotations

import attrs

from ksana.cache.block_allocator import BlockAllocator, BlockAllocatorError


@attrs.define(eq=False)
class SWABlock:
    block_id: int
    fa_block_id: int = -1
    is_content_fixed: bool = False
    hit_count: int = 0
    prefix_fa_block_num: int = 0
    num_holders: int = 1

    @property
    def is_reclaimable(self) -> bool:
        return self.num_holders == 0


class SWACacheManager:
    """Owns SWA block ids; the prefix cache manager calls it, nothing else does."""

    def __init__(self, num_blocks: int) -> None:
        self.allocator = BlockAllocator(num_blocks)  # the idle pool
        self.blocks: dict[int, SWABlock] = {}  # every block not idle
        self.by_fa_block: dict[int, SWABlock] = {}  # content-fixed blocks by their FA block id
        self.num_evictions = 0

    @property
    def num_total_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    def num_reclaimable_blocks(self) -> int:
        return sum(1 for b in self.by_fa_block.values() if b.is_reclaimable)

    def can_allocate(self, num: int) -> bool:
        idle = self.allocator.num_free_blocks
        return num <= idle or num <= idle + self.num_reclaimable_blocks()

    def allocate(self, num: int) -> list[int] | None:
        """``num`` blocks, each held once; idle blocks first, then evictions; None (nothing changed) if short."""
        if not self.can_allocate(num):
            return None
        from_idle = min(num, self.allocator.num_free_blocks)
        ids = self.allocator.allocate(from_idle)
        for _ in range(num - from_idle):
            ids.append(self._evict_one())
        for block_id in ids:
            self.blocks[block_id] = SWABlock(block_id)
        return ids

    def eviction_candidate(self) -> SWABlock | None:
        """The lowest-value reclaimable content-fixed block: (hit_count, prefix_fa_block_num) ascending."""
        candidates = [b for b in self.by_fa_block.values() if b.is_reclaimable]
        if not candidates:
            return None
        return min(candidates, key=lambda b: (b.hit_count, b.prefix_fa_block_num))

    def _evict_one(self) -> int:
        victim = self.eviction_candidate()
        if victim is None:
            raise BlockAllocatorError("no reclaimable content-fixed SWA block to evict")
        del self.by_fa_block[victim.fa_block_id]
        del self.blocks[victim.block_id]
        self.num_evictions += 1
        return victim.block_id

    def set_content_fixed(self, block_id: int, fa_block_id: int, prefix_fa_block_num: int) -> None:
        """``block_id`` now holds the final KV of FA block ``fa_block_id`` (the ``prefix_fa_block_num``-th)."""
        block = self.blocks[block_id]
        if fa_block_id in self.by_fa_block:
            raise BlockAllocatorError(f"FA block {fa_block_id} already has an SWA block")
        block.is_content_fixed = True
        block.fa_block_id = fa_block_id
        block.prefix_fa_block_num = prefix_fa_block_num
        self.by_fa_block[fa_block_id] = block

    def set_reclaimable(self, fa_block_id: int, reclaimable: bool) -> None:
        block = self.by_fa_block[fa_block_id]
        if reclaimable:
            if block.num_holders == 0:
                raise BlockAllocatorError(f"SWA block of FA block {fa_block_id} released but not held")
            block.num_holders -= 1
        else:
            block.num_holders += 1

    def increment_hit_count(self, fa_block_id: int) -> None:
        self.by_fa_block[fa_block_id].hit_count += 1

    def is_valid(self, fa_block_id: int) -> bool:
        return fa_block_id in self.by_fa_block

    def swa_block_of(self, fa_block_id: int) -> int:
        return self.by_fa_block[fa_block_id].block_id

    def release(self, block_id: int) -> None:
        """A request lets go of ``block_id``: a content-fixed block stays cached (reclaimable once no one holds
        it); any other block goes straight back to the idle pool."""
        block = self.blocks[block_id]
        if block.is_content_fixed:
            self.set_reclaimable(block.fa_block_id, True)
        else:
            del self.blocks[block_id]
            self.allocator.free([block_id])

    def drop(self, fa_block_id: int) -> None:
        """The FA block was evicted from the prefix cache: its SWA copy has no key left, so it goes idle."""
        block = self.by_fa_block.pop(fa_block_id, None)
        if block is None:
            return
        if not block.is_reclaimable:
            raise BlockAllocatorError(f"FA block {fa_block_id} evicted while its SWA block is held")
        del self.blocks[block.block_id]
        self.allocator.free([block.block_id])
