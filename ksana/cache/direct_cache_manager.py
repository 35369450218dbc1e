"""DirectCacheManager: private blocks per request, no sharing (KsanaLLM's manager when prefix caching is off)."""

from __future__ import annotations

from ksana.cache.block_allocator import BlockAllocator
from ksana.cache.interface import DemandGrant
from ksana.messages import BlockDemand, RemoteBlock


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class DirectCacheManager:
    """Maps request ids to their block tables and grows them on demand (a ``CacheManager``)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_total_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    @property
    def num_requests_with_blocks(self) -> int:
        return len(self.block_tables)

    def num_missing_blocks(self, request_id: str, num_tokens: int) -> int:
        have = len(self.block_tables.get(request_id, ()))
        return max(0, num_blocks_for(num_tokens, self.block_size) - have)

    def grow(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Make room for ``num_tokens`` tokens; None (and nothing allocated) when the pool is short."""
        missing = self.num_missing_blocks(request_id, num_tokens)
        if not self.allocator.can_allocate(missing):
            return None
        table = self.block_tables.setdefault(request_id, [])
        table.extend(self.allocator.allocate(missing))
        return table

    def serve_demand(self, demand: BlockDemand) -> DemandGrant | None:
        """Private blocks only: a ``match_prefix`` demand matches nothing and grows like any other."""
        table = self.grow(demand.request_id, demand.num_tokens)
        return None if table is None else DemandGrant(block_ids=tuple(table))

    def free_request(self, request_id: str) -> None:
        table = self.block_tables.pop(request_id, None)
        if table:
            self.allocator.free(table)

    def take_pending_saves(self) -> tuple[RemoteBlock, ...]:
        return ()  # no remote store without the prefix cache

    def hit_stats(self) -> dict[str, int]:
        return {}
