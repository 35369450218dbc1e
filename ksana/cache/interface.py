"""The one interface both cache managers offer the cache-manager actor.

``DirectCacheManager`` (prefix caching off) and ``PrefixCacheManager`` (prefix tree, SWA pool, remote loading)
answer the same calls, so the actor, the engine and the simulator hold a ``CacheManager`` and never ask which
one it is. Like nano-vllm's block manager, allocation and release come in pairs (``serve_demand`` /
``free_request``); there is no separate "can allocate" predicate because with the prefix cache the answer depends
on the prefix match, which ``serve_demand`` makes: it grants the demand or refuses it atomically.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import attrs

from ksana.messages import BlockDemand, RemoteBlock, RemoteLoad


@attrs.define
class DemandGrant:
    """What one demand got: its block table (and SWA table where the manager keeps an SWA pool) and, for a
    ``match_prefix`` demand, the matched tokens; or, instead, a remote load to run first."""

    block_ids: tuple[int, ...] = ()
    swa_block_ids: tuple[int, ...] | None = None  # None: no SWA pool
    num_cached_tokens: int | None = None  # None: not a ``match_prefix`` demand, or no prefix cache
    remote_load: RemoteLoad | None = None


@runtime_checkable
class CacheManager(Protocol):
    """Block state for every request; only the cache-manager actor calls it."""

    block_size: int

    @property
    def num_total_blocks(self) -> int: ...

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (idle, plus cached-but-unreferenced ones with the prefix cache)."""
        ...

    @property
    def num_requests_with_blocks(self) -> int: ...

    def serve_demand(self, demand: BlockDemand) -> DemandGrant | None:
        """Grow the request to ``demand.num_tokens`` tokens for this step; None when the pool is short."""
        ...

    def free_request(self, request_id: str) -> None:
        """Release everything the request holds (a no-op for an unknown id)."""
        ...

    def take_pending_saves(self) -> tuple[RemoteBlock, ...]:
        """Blocks filled since the last call that the remote store should receive."""
        ...

    def hit_stats(self) -> dict[str, int]:
        """Prefix-cache counters for ``CacheStats`` (empty without a prefix cache)."""
        ...
