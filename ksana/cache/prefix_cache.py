"""PrefixCacheManager: refcounted full blocks in a hash-chained prefix tree, with SWA and remote cache loading.

A block enters the tree once it is full: its key chains the parent's hash with its token ids (blake2b, stable
across processes so a remote store can share keys); a lookup also compares parent and tokens, so a hash collision
is a miss, never a wrong reuse. Requests with the same prefix share its blocks (refcounts); unreferenced tree blocks
stay cached, in least-recently-released order, until an allocation evicts them. A block whose twin is already in
the tree stays private to its request (no merge: the tables the worker holds never change under it).

A match never covers the last prompt token: a full-prompt hit still computes one token, whose logits are needed.
With sliding-window layers the match runs in the seed's two phases (``_match``), and SWA blocks come from the
``SWACacheManager``. Remote cache loading follows the seed's sequence; while a request ``is_remote_loading``,
``allocate_request_blocks``, ``update_request_tokens`` and ``append_filled_cached_block`` raise.
"""

from __future__ import annotations

import collections
import hashlib
from array import array

import attrs

from ksana.cache.block_allocator import BlockAllocator, BlockAllocatorError
from ksana.cache.interface import DemandGrant
from ksana.cache.remote_loading import RemoteKVStore
from ksana.cache.swa_cache import SWACacheManager
from ksana.messages import BlockDemand, RemoteBlock, RemoteLoad

ROOT_HASH = 0


class RemoteLoadingError(RuntimeError):
    """An inference call reached a request whose remote load is not confirmed yet."""


def chain_hash(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """The block's key: 128-bit blake2b of the parent's key and the block's token ids."""
    data = parent_hash.to_bytes(16, "little") + array("q", token_ids).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=16).digest(), "little")


@attrs.define(eq=False)
class PrefixCachedBlock:
    block_id: int
    hash_code: int = ROOT_HASH
    parent_hash: int = ROOT_HASH
    token_ids: tuple[int, ...] = ()
    is_shareable: bool = False  # full and in the tree
    ref_count: int = 0  # requests holding it (tree blocks only)
    prefix_fa_block_num: int = 0  # its index in the chain


@attrs.define(eq=False)
class PrefixCachedRequest:
    req_id: str
    token_ids: list[int] = attrs.field(factory=list)
    cached_blocks: list[PrefixCachedBlock] = attrs.field(factory=list)  # the request's FA block table
    block_hashes: list[int] = attrs.field(factory=list)  # chain keys of its full blocks, in order
    swa_block_ids: list[int] = attrs.field(factory=list)  # per FA position; -1 outside the window
    num_swa_released: int = 0  # SWA positions below this have been let go
    num_scheduled_tokens: int = 0  # tokens whose KV is (or is being) written
    shared_block_num: int = 0
    is_remote_loading: bool = False
    is_remote_loading_block_allocated: bool = False
    remote_fa_block_ids: list[int] = attrs.field(factory=list)
    remote_swa_block_ids: list[int] = attrs.field(factory=list)
    remote_hashes: list[int] = attrs.field(factory=list)

    @property
    def num_filled_blocks(self) -> int:
        return len(self.block_hashes)


@attrs.define
class PrefixCacheStats:
    prefix_cache_hit_req_num: int = 0
    prefix_cache_hit_token_num: int = 0
    prefix_cache_hit_block_num: int = 0
    full_prompt_matched_req_num: int = 0
    remote_loaded_block_num: int = 0


class PrefixCacheManager:
    """The prefix tree over the block pool (a ``CacheManager``), with the seed's API for SWA and remote loading."""

    def __init__(self, num_blocks: int, block_size: int, swa: SWACacheManager | None = None,
                 sliding_window: int | None = None, remote_store: RemoteKVStore | None = None) -> None:
        if (swa is None) != (sliding_window is None):
            raise ValueError("an SWACacheManager needs the sliding window and vice versa")
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.swa = swa
        self.sliding_window = sliding_window
        self.sliding_window_blocks = -(-sliding_window // block_size) if sliding_window else 0
        self.remote_store = remote_store
        self.tree: dict[int, PrefixCachedBlock] = {}  # hash -> block
        self.reusable: collections.OrderedDict[int, PrefixCachedBlock] = collections.OrderedDict()
        self.requests: dict[str, PrefixCachedRequest] = {}
        self.stats = PrefixCacheStats()
        self.pending_saves: list[RemoteBlock] = []
        self._saved_hashes: set[int] = set()

    # ---- counts ---------------------------------------------------------------------------------------------
    @property
    def num_total_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Usable blocks: idle plus cached-but-unreferenced (evictable)."""
        return self.allocator.num_free_blocks + len(self.reusable)

    @property
    def num_requests_with_blocks(self) -> int:
        return len(self.requests)

    def hit_stats(self) -> dict[str, int]:
        s = self.stats
        return dict(prefix_cache_hit_req_num=s.prefix_cache_hit_req_num,
                    prefix_cache_hit_token_num=s.prefix_cache_hit_token_num,
                    prefix_cache_hit_block_num=s.prefix_cache_hit_block_num,
                    full_prompt_matched_req_num=s.full_prompt_matched_req_num,
                    num_cached_blocks=len(self.tree))

    @property
    def block_tables(self) -> dict[str, list[int]]:
        return {rid: [b.block_id for b in r.cached_blocks] for rid, r in self.requests.items()}

    # ---- the seed's API -------------------------------------------------------------------------------------
    def get_request_prefix_block_number(self, req_id: str, token_ids: list[int] | None = None) -> int:
        """Match and attach the longest valid cached prefix of a request that holds no blocks yet; returns the
        number of shared blocks (0 when nothing matches)."""
        req = self._request(req_id, token_ids)
        self._check_not_loading(req, "get_request_prefix_block_number")
        if req.cached_blocks:
            return req.shared_block_num
        matched, hashes = self._match(req.token_ids)
        self._attach(req, matched, hashes)
        return len(matched)

    def get_request_prefix_block_number_before_remote_cache_loading(
            self, req_id: str, token_ids: list[int] | None = None) -> int:
        """Step 1 of remote loading: the local hit range (matched and attached like a plain match)."""
        return self.get_request_prefix_block_number(req_id, token_ids)

    def allocate_blocks_for_remote_cache(self, req_id: str, fa_block_num: int,
                                         swa_block_num: int) -> tuple[list[int], list[int]] | None:
        """Step 2: reserve FA blocks for the next ``fa_block_num`` prefix blocks and SWA blocks for the last
        ``swa_block_num`` of them; None (nothing reserved) when the pools are short."""
        req = self.requests[req_id]
        self._check_not_loading(req, "allocate_blocks_for_remote_cache")
        fa = self._allocate_fa(fa_block_num)
        if fa is None:
            return None
        swa: list[int] = []
        if swa_block_num:
            got = self.swa.allocate(swa_block_num) if self.swa is not None else None
            if got is None:
                self.allocator.free(fa)
                return None
            swa = got
        req.remote_fa_block_ids, req.remote_swa_block_ids = fa, swa
        req.is_remote_loading = req.is_remote_loading_block_allocated = True
        return fa, swa

    def confirm_remote_cache_loading_result(self, req_id: str, matched_block_index: int,
                                            matched_remote_swa_block_indexs: list[int],
                                            reserved_block_num: int) -> None:
        """Step 4: blocks ``[shared, matched_block_index)`` hold loaded KV (the first ``reserved_block_num``
        reserved FA blocks); the SWA blocks of the FA positions ``matched_remote_swa_block_indexs`` were loaded
        too and move to those positions. Everything else reserved is released; the request leaves the
        remote-loading state with the loaded blocks in its ``cached_blocks`` (and in the tree)."""
        req = self.requests[req_id]
        if not req.is_remote_loading:
            raise RemoteLoadingError(f"confirm_remote_cache_loading_result: request {req_id} is not loading")
        start = len(req.cached_blocks)
        if matched_block_index != start + reserved_block_num or reserved_block_num > len(req.remote_fa_block_ids):
            raise ValueError(f"request {req_id}: matched_block_index {matched_block_index} != "
                             f"{start} held + {reserved_block_num} loaded")
        num_reserved = len(req.remote_fa_block_ids)
        swa_first = start + num_reserved - len(req.remote_swa_block_ids)  # FA position of the first SWA block
        kept_swa = set()
        for index in matched_remote_swa_block_indexs:
            if not swa_first <= index < matched_block_index:
                raise ValueError(f"request {req_id}: SWA index {index} outside [{swa_first}, {matched_block_index})")
            kept_swa.add(index)
        for j, block_id in enumerate(req.remote_fa_block_ids):
            index = start + j
            if j >= reserved_block_num:
                self.allocator.free([block_id])
                continue
            swa_id = -1
            if index >= swa_first:
                swa_id = req.remote_swa_block_ids[index - swa_first]
            if index not in kept_swa and swa_id >= 0:
                self.swa.release(swa_id)
                swa_id = -1
            block = PrefixCachedBlock(block_id)
            req.cached_blocks.append(block)
            req.swa_block_ids.append(swa_id)
            self._fill(req, index, req.remote_hashes[j])
        for j in range(max(0, reserved_block_num - swa_first + start), len(req.remote_swa_block_ids)):
            self.swa.release(req.remote_swa_block_ids[j])
        self.stats.remote_loaded_block_num += reserved_block_num
        req.remote_fa_block_ids, req.remote_swa_block_ids, req.remote_hashes = [], [], []
        req.is_remote_loading = req.is_remote_loading_block_allocated = False
        # Re-check the continuous window condition over the result and keep only the valid prefix.
        self._truncate(req, self._valid_endpoint(req.cached_blocks))
        self._register_window(req)
        req.shared_block_num = len(req.cached_blocks)
        req.num_scheduled_tokens = len(req.cached_blocks) * self.block_size

    def allocate_request_blocks(self, req_id: str, num_blocks: int) -> list[int] | None:
        """Append ``num_blocks`` new private blocks (evicting unreferenced cached blocks if the pool is short);
        None and nothing changed when even eviction cannot make room."""
        req = self.requests[req_id]
        self._check_not_loading(req, "allocate_request_blocks")
        ids = self._allocate_fa(num_blocks)
        if ids is None:
            return None
        swa_ids: list[int] = []
        if self.swa is not None and ids:
            got = self.swa.allocate(len(ids))
            if got is None:
                self.allocator.free(ids)
                return None
            swa_ids = got
        req.cached_blocks.extend(PrefixCachedBlock(b) for b in ids)
        req.swa_block_ids.extend(swa_ids if self.swa is not None else [-1] * len(ids))
        return ids

    def update_request_tokens(self, req_id: str, new_token_ids, num_filled_tokens: int) -> None:
        """The request's next tokens, and how many of its tokens have their KV written once this step runs:
        each block that becomes full enters the tree."""
        req = self.requests[req_id]
        self._check_not_loading(req, "update_request_tokens")
        req.token_ids.extend(new_token_ids)
        num_full = min(num_filled_tokens, len(req.token_ids)) // self.block_size
        while req.num_filled_blocks < num_full:
            self.append_filled_cached_block(req_id, req.num_filled_blocks)
        req.num_scheduled_tokens = num_filled_tokens

    def append_filled_cached_block(self, req_id: str, block_index: int) -> None:
        """Block ``block_index`` of the request is full: key it and put it in the tree (unless a twin is)."""
        req = self.requests[req_id]
        self._check_not_loading(req, "append_filled_cached_block")
        if block_index != req.num_filled_blocks:
            raise ValueError(f"request {req_id}: block {block_index} filled out of order")
        bs = self.block_size
        tokens = tuple(req.token_ids[block_index * bs:(block_index + 1) * bs])
        parent = req.block_hashes[-1] if req.block_hashes else ROOT_HASH
        self._fill(req, block_index, chain_hash(parent, tokens))

    def free_request(self, req_id: str) -> None:
        """The request is done (finished, aborted or preempted): shared blocks lose a reference and stay cached
        when unreferenced; private and reserved blocks go back to the pool."""
        req = self.requests.pop(req_id, None)
        if req is None:
            return
        for block in req.cached_blocks:
            self._release_fa(block)
        for swa_id in req.swa_block_ids:
            if swa_id >= 0:
                self.swa.release(swa_id)
        if req.remote_fa_block_ids:
            self.allocator.free(req.remote_fa_block_ids)
        for swa_id in req.remote_swa_block_ids:
            self.swa.release(swa_id)

    # ---- one step's demand ----------------------------------------------------------------------------------
    def serve_demand(self, demand: BlockDemand) -> DemandGrant | None:
        """Grow one request for this step (matching its prefix first when it holds no blocks); None when the pool
        is short, with everything the request held released."""
        req_id, bs = demand.request_id, self.block_size
        req = self.requests.get(req_id)
        num_cached = None
        if demand.match_prefix:
            if req is not None and req.is_remote_loading:
                self._confirm_from_worker(req, demand.num_remote_loaded_blocks)
            else:
                self.free_request(req_id)
                req = self._request(req_id, list(demand.token_ids))
                load = self._start_match(req)
                if load is not None:
                    return DemandGrant(remote_load=load)
            num_cached = len(req.cached_blocks) * bs
            num_tokens = min(num_cached + demand.num_tokens, len(req.token_ids))
        else:
            if req is None:
                req = self._request(req_id, [])
            num_tokens = demand.num_tokens
        missing = -(-num_tokens // bs) - len(req.cached_blocks)
        self._release_outside_window(req, req.num_scheduled_tokens)
        if missing > 0 and self.allocate_request_blocks(req_id, missing) is None:
            self.free_request(req_id)
            return None
        self.update_request_tokens(req_id, () if demand.match_prefix else demand.token_ids, num_tokens)
        if num_cached is not None:
            self._count_hit(req, num_cached)
        return DemandGrant(
            block_ids=tuple(b.block_id for b in req.cached_blocks),
            swa_block_ids=tuple(req.swa_block_ids) if self.swa is not None else None,
            num_cached_tokens=num_cached,
        )

    def take_pending_saves(self) -> tuple[RemoteBlock, ...]:
        saves, self.pending_saves = tuple(self.pending_saves), []
        return saves

    # ---- internals ------------------------------------------------------------------------------------------
    def _request(self, req_id: str, token_ids: list[int] | None) -> PrefixCachedRequest:
        req = self.requests.get(req_id)
        if req is None:
            req = self.requests[req_id] = PrefixCachedRequest(req_id, list(token_ids or ()))
        return req

    @staticmethod
    def _check_not_loading(req: PrefixCachedRequest, call: str) -> None:
        if req.is_remote_loading:
            raise RemoteLoadingError(f"{call} is not allowed while request {req.req_id} is remote loading")

    def _match(self, token_ids: list[int]) -> tuple[list[PrefixCachedBlock], list[int]]:
        """The longest cached prefix (never the last token), cut to the furthest endpoint that meets the
        continuous window condition when there are sliding-window layers."""
        bs = self.block_size
        matched: list[PrefixCachedBlock] = []
        hashes: list[int] = []
        parent = ROOT_HASH
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            key = chain_hash(parent, tokens)
            block = self.tree.get(key)
            if block is None or block.parent_hash != parent or block.token_ids != tokens:
                break
            matched.append(block)
            hashes.append(key)
            parent = key
        end = self._valid_endpoint(matched)
        return matched[:end], hashes[:end]

    def _valid_endpoint(self, blocks: list[PrefixCachedBlock]) -> int:
        """Phase 1 (scan): the furthest index whose last ``W_blocks`` blocks all have a valid SWA block."""
        if self.swa is None:
            return len(blocks)
        swa_valid_in_window, last_swa_valid_idx = 0, 0
        for idx, block in enumerate(blocks):
            if self.swa.is_valid(block.block_id):
                swa_valid_in_window += 1
            else:
                swa_valid_in_window = 0
            if swa_valid_in_window >= self.sliding_window_blocks:
                last_swa_valid_idx = idx + 1
        return last_swa_valid_idx

    def _attach(self, req: PrefixCachedRequest, matched: list[PrefixCachedBlock], hashes: list[int]) -> None:
        for block in matched:
            if block.ref_count == 0:
                del self.reusable[block.block_id]
            block.ref_count += 1
        req.cached_blocks = list(matched)
        req.block_hashes = list(hashes)
        req.swa_block_ids = [-1] * len(matched)
        req.shared_block_num = len(matched)
        req.num_scheduled_tokens = len(matched) * self.block_size
        self._register_window(req)

    def _register_window(self, req: PrefixCachedRequest) -> None:
        """Phase 2 (registration): hold the SWA blocks of ``[win_start, last_swa_valid_idx)``."""
        if self.swa is None:
            return
        last = len(req.cached_blocks)
        win_start = max(0, last - self.sliding_window_blocks)
        for idx in range(win_start, last):
            if req.swa_block_ids[idx] >= 0:
                continue  # already held (loaded from the remote store)
            fa_block_id = req.cached_blocks[idx].block_id
            self.swa.set_reclaimable(fa_block_id, False)
            self.swa.increment_hit_count(fa_block_id)
            req.swa_block_ids[idx] = self.swa.swa_block_of(fa_block_id)
        for idx in range(win_start):
            if req.swa_block_ids[idx] >= 0:
                self.swa.release(req.swa_block_ids[idx])
                req.swa_block_ids[idx] = -1
        req.num_swa_released = win_start

    def _truncate(self, req: PrefixCachedRequest, num_blocks: int) -> None:
        while len(req.cached_blocks) > num_blocks:
            self._release_fa(req.cached_blocks.pop())
            swa_id = req.swa_block_ids.pop()
            if swa_id >= 0:
                self.swa.release(swa_id)
        del req.block_hashes[num_blocks:]

    def _fill(self, req: PrefixCachedRequest, index: int, key: int) -> None:
        block = req.cached_blocks[index]
        req.block_hashes.append(key)
        if block.is_shareable or key in self.tree:
            return  # matched earlier, or a twin is cached: this copy stays private
        bs = self.block_size
        block.hash_code = key
        block.parent_hash = req.block_hashes[-2] if len(req.block_hashes) > 1 else ROOT_HASH
        block.token_ids = tuple(req.token_ids[index * bs:(index + 1) * bs])
        block.is_shareable = True
        block.ref_count = 1
        block.prefix_fa_block_num = index
        self.tree[key] = block
        swa_id = req.swa_block_ids[index] if self.swa is not None else -1
        if swa_id >= 0:
            self.swa.set_content_fixed(swa_id, block.block_id, index)
        if self.remote_store is not None and key not in self._saved_hashes:
            self._saved_hashes.add(key)
            if (self.swa is None or swa_id >= 0) and not self.remote_store.contains(key):
                self.pending_saves.append(RemoteBlock(key, block.block_id, swa_id))

    def _release_fa(self, block: PrefixCachedBlock) -> None:
        if block.is_shareable:
            block.ref_count -= 1
            if block.ref_count == 0:
                self.reusable[block.block_id] = block
        else:
            self.allocator.free([block.block_id])

    def _allocate_fa(self, num: int) -> list[int] | None:
        short = num - self.allocator.num_free_blocks
        if short > len(self.reusable):
            return None
        for _ in range(max(0, short)):
            _, victim = self.reusable.popitem(last=False)
            del self.tree[victim.hash_code]
            if self.swa is not None:
                self.swa.drop(victim.block_id)
            victim.is_shareable = False
            self.allocator.free([victim.block_id])
        return self.allocator.allocate(num)

    def _release_outside_window(self, req: PrefixCachedRequest, start: int) -> None:
        """SWA blocks that no query from position ``start`` on can see go back (cached if content fixed)."""
        if self.swa is None:
            return
        limit = min(max(0, (start - self.sliding_window + 1) // self.block_size), len(req.swa_block_ids))
        for idx in range(req.num_swa_released, limit):
            if req.swa_block_ids[idx] >= 0:
                self.swa.release(req.swa_block_ids[idx])
                req.swa_block_ids[idx] = -1
        req.num_swa_released = max(req.num_swa_released, limit)

    def _count_hit(self, req: PrefixCachedRequest, num_cached: int) -> None:
        if num_cached == 0:
            return
        stats = self.stats
        stats.prefix_cache_hit_req_num += 1
        stats.prefix_cache_hit_token_num += num_cached
        stats.prefix_cache_hit_block_num += num_cached // self.block_size
        if num_cached // self.block_size == (len(req.token_ids) - 1) // self.block_size:
            stats.full_prompt_matched_req_num += 1  # every block a match may cover

    # ---- remote loading, driven by the demand --------------------------------------------------------------
    def _start_match(self, req: PrefixCachedRequest) -> RemoteLoad | None:
        """Match locally; with a remote store, reserve blocks for the remote continuation and return the load."""
        if self.remote_store is None:
            self.get_request_prefix_block_number(req.req_id)
            return None
        num_local = self.get_request_prefix_block_number_before_remote_cache_loading(req.req_id)
        bs = self.block_size
        hashes = []
        parent = req.block_hashes[-1] if req.block_hashes else ROOT_HASH
        for i in range(num_local, (len(req.token_ids) - 1) // bs):
            key = chain_hash(parent, tuple(req.token_ids[i * bs:(i + 1) * bs]))
            if key in self.tree or not self.remote_store.contains(key):
                break
            hashes.append(key)
            parent = key
        if not hashes:
            return None
        num_swa = min(self.sliding_window_blocks, len(hashes)) if self.swa is not None else 0
        reserved = self.allocate_blocks_for_remote_cache(req.req_id, len(hashes), num_swa)
        if reserved is None:
            return None  # no room: compute instead
        fa_ids, swa_ids = reserved
        req.remote_hashes = hashes
        swa_for = [-1] * (len(hashes) - num_swa) + swa_ids
        blocks = tuple(RemoteBlock(h, fa, s) for h, fa, s in zip(hashes, fa_ids, swa_for, strict=True))
        return RemoteLoad(req.req_id, blocks)

    def _confirm_from_worker(self, req: PrefixCachedRequest, num_loaded: int) -> None:
        """Turn the worker's count of consecutive loaded blocks into step 4's arguments."""
        num_loaded = max(0, min(num_loaded, len(req.remote_fa_block_ids)))
        start = len(req.cached_blocks)
        swa_first = start + len(req.remote_fa_block_ids) - len(req.remote_swa_block_ids)
        swa_indexes = list(range(swa_first, start + num_loaded))
        self.confirm_remote_cache_loading_result(req.req_id, start + num_loaded, swa_indexes, num_loaded)

    def check_invariants(self) -> None:
        """Test hook: refcounts equal owners, no block owned twice, free + used = total."""
        owners: collections.Counter[int] = collections.Counter()
        private: set[int] = set()
        for req in self.requests.values():
            for block in req.cached_blocks:
                if block.is_shareable:
                    owners[block.block_id] += 1
                else:
                    if block.block_id in private:
                        raise BlockAllocatorError(f"private block {block.block_id} owned twice")
                    private.add(block.block_id)
            private.update(req.remote_fa_block_ids)
        tree_ids = {b.block_id: b for b in self.tree.values()}
        for block_id, block in tree_ids.items():
            if block.ref_count != owners.get(block_id, 0):
                raise BlockAllocatorError(f"block {block_id}: ref_count {block.ref_count} != {owners[block_id]}")
            if (block.ref_count == 0) != (block_id in self.reusable):
                raise BlockAllocatorError(f"block {block_id}: reusable state wrong")
        if private & tree_ids.keys():
            raise BlockAllocatorError("a private block is also in the tree")
        if set(owners) - tree_ids.keys():
            raise BlockAllocatorError("a shared block is not in the tree")
        used = len(private) + len(tree_ids)
        if used + self.allocator.num_free_blocks != self.allocator.num_blocks:
            raise BlockAllocatorError(f"free {self.allocator.num_free_blocks} + used {used} != total")
        if self.swa is not None:
            holders: collections.Counter[int] = collections.Counter()
            for req in self.requests.values():
                for swa_id in list(req.swa_block_ids) + list(req.remote_swa_block_ids):
                    if swa_id >= 0:
                        holders[swa_id] += 1
            for swa_id, block in self.swa.blocks.items():
                if not block.is_content_fixed and holders[swa_id] != 1:
                    raise BlockAllocatorError(f"SWA block {swa_id} held {holders[swa_id]} times, not fixed")
                if block.is_content_fixed and block.num_holders != holders[swa_id]:
                    raise BlockAllocatorError(f"SWA block {swa_id}: {block.num_holders} != {holders[swa_id]}")
                if block.is_content_fixed and block.fa_block_id not in tree_ids:
                    raise BlockAllocatorError(f"SWA block {swa_id} tied to uncached FA {block.fa_block_id}")
            if len(self.swa.blocks) + self.swa.num_free_blocks != self.swa.num_total_blocks:
                raise BlockAllocatorError("SWA free + used != total")
