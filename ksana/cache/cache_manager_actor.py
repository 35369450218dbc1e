"""The cache-manager actor: the only owner of block state; the scheduler asks it once per step.

It serves any ``CacheManager`` (``ksana/cache/interface.py``): ``DirectCacheManager`` (prefix caching off:
private blocks, nothing to match) or ``PrefixCacheManager`` (prefix tree, SWA blocks, remote loading);
``make_cache_manager`` picks one from the configuration.
"""

from __future__ import annotations

import logging

from ksana.cache.direct_cache_manager import DirectCacheManager
from ksana.cache.interface import CacheManager
from ksana.cache.prefix_cache import PrefixCacheManager
from ksana.cache.remote_loading import RemoteKVStore
from ksana.cache.swa_cache import SWACacheManager
from ksana.events import Actor, handles
from ksana.messages import (
    AllocateStepBlocks,
    CacheStats,
    FreeRequestBlocks,
    GetCacheStats,
    RemoteLoad,
    StepBlocks,
)

logger = logging.getLogger(__name__)


def make_cache_manager(num_blocks: int, block_size: int, enable_prefix_cache: bool,
                       sliding_window: int | None = None, num_swa_blocks: int = 0,
                       remote_store: RemoteKVStore | None = None) -> CacheManager:
    """KsanaLLM's factory: the prefix cache manager when enabled (with an SWA pool for sliding-window models),
    else the direct one."""
    if not enable_prefix_cache:
        return DirectCacheManager(num_blocks, block_size)
    swa = SWACacheManager(num_swa_blocks or num_blocks) if sliding_window else None
    return PrefixCacheManager(num_blocks, block_size, swa=swa, sliding_window=sliding_window,
                              remote_store=remote_store)


class CacheManagerActor(Actor):
    name = "cache_manager"

    def __init__(self, manager: CacheManager) -> None:
        self.manager = manager

    @handles(AllocateStepBlocks)
    async def on_allocate(self, msg: AllocateStepBlocks) -> StepBlocks:
        manager = self.manager
        for request_id in msg.release:
            manager.free_request(request_id)
        tables: dict[str, tuple[int, ...]] = {}
        swa_tables: dict[str, tuple[int, ...]] = {}
        cached: dict[str, int] = {}
        loads: list[RemoteLoad] = []
        refused: list[str] = []
        for demand in msg.demands:
            grant = None if refused else manager.serve_demand(demand)
            if grant is None:
                refused.append(demand.request_id)
            elif grant.remote_load is not None:
                loads.append(grant.remote_load)
            else:
                tables[demand.request_id] = grant.block_ids
                if grant.swa_block_ids is not None:
                    swa_tables[demand.request_id] = grant.swa_block_ids
                if grant.num_cached_tokens is not None:
                    cached[demand.request_id] = grant.num_cached_tokens
        return StepBlocks(block_tables=tables, refused=tuple(refused), num_free_blocks=manager.num_free_blocks,
                          swa_block_tables=swa_tables, num_cached_tokens=cached, remote_loads=tuple(loads),
                          remote_saves=manager.take_pending_saves())

    @handles(FreeRequestBlocks)
    async def on_free(self, msg: FreeRequestBlocks) -> None:
        for request_id in msg.request_ids:
            self.manager.free_request(request_id)

    @handles(GetCacheStats)
    async def on_stats(self, msg: GetCacheStats) -> CacheStats:
        manager = self.manager
        return CacheStats(
            num_total_blocks=manager.num_total_blocks,
            num_free_blocks=manager.num_free_blocks,
            block_size=manager.block_size,
            num_requests_with_blocks=manager.num_requests_with_blocks,
            **manager.hit_stats(),
        )
