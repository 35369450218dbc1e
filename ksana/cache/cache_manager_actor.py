"""The cache-manager actor: the only owner of block state; the scheduler asks it once per step."""

from __future__ import annotations

import logging

from events import Actor, handles
from events.messages import (
    AllocateStepBlocks,
    CacheStats,
    FreeRequestBlocks,
    GetCacheStats,
    StepBlocks,
)
from ksana.cache.direct_cache_manager import DirectCacheManager

logger = logging.getLogger(__name__)


class CacheManagerActor(Actor):
    name = "cache_manager"

    def __init__(self, manager: DirectCacheManager) -> None:
        self.manager = manager

    @handles(AllocateStepBlocks)
    async def on_allocate(self, msg: AllocateStepBlocks) -> StepBlocks:
        for request_id in msg.release:
            self.manager.free_request(request_id)
        tables: dict[str, tuple[int, ...]] = {}
        refused: list[str] = []
        for demand in msg.demands:
            table = None if refused else self.manager.grow(demand.request_id, demand.num_tokens)
            if table is None:
                refused.append(demand.request_id)
            else:
                tables[demand.request_id] = tuple(table)
        return StepBlocks(block_tables=tables, refused=tuple(refused), num_free_blocks=self.manager.num_free_blocks)

    @handles(FreeRequestBlocks)
    async def on_free(self, msg: FreeRequestBlocks) -> None:
        for request_id in msg.request_ids:
            self.manager.free_request(request_id)

    @handles(GetCacheStats)
    async def on_stats(self, msg: GetCacheStats) -> CacheStats:
        return CacheStats(
            num_total_blocks=self.manager.num_total_blocks,
            num_free_blocks=self.manager.num_free_blocks,
            block_size=self.manager.block_size,
            num_requests_with_blocks=len(self.manager.block_tables),
        )
