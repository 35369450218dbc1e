"""Hypothesis state machine over the cache managers: random allocate / update / fork (a request sharing another's
prompt) / free / abort / remote-load sequences, with and without an SWA pool. Invariants after every step: no block
owned twice, reference counts equal owners, free + used = total (FA and SWA pools); nothing leaks once every
request has ended."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ksana.cache.prefix_cache import PrefixCacheManager
from ksana.cache.swa_cache import SWACacheManager
from ksana.messages import BlockDemand

B = 4
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 7, 7, 7, 7], [5] * 13]


class FakeRemote:
    """Holds hashes only: which blocks a remote load may find."""

    def __init__(self) -> None:
        self.hashes: set[int] = set()

    def contains(self, block_hash: int) -> bool:
        return block_hash in self.hashes


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.manager: PrefixCacheManager | None = None
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.next_id = 0

    @precondition(lambda self: self.manager is None)
    @rule(with_swa=st.booleans(), num_swa=st.integers(5, 12), remote=st.booleans())
    def build(self, with_swa, num_swa, remote):
        swa = SWACacheManager(num_swa) if with_swa else None
        self.remote = FakeRemote() if remote else None
        self.manager = PrefixCacheManager(10, B, swa=swa, sliding_window=6 if with_swa else None,
                                          remote_store=self.remote)

    @precondition(lambda self: self.manager is not None)
    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(1, 9), max_size=6),
          chunk=st.integers(1, 12))
    def arrive(self, prefix, suffix, chunk):
        rid = f"r{self.next_id}"
        self.next_id += 1
        tokens = prefix + suffix
        grant = self.manager.serve_demand(BlockDemand(rid, chunk, tuple(tokens), match_prefix=True))
        if grant is None:
            assert rid not in self.manager.requests  # a refusal leaves nothing behind
            return
        self.tokens[rid] = tokens
        if grant.remote_load is not None:
            self.computed[rid] = -1  # loading
            return
        self.computed[rid] = min(grant.num_cached_tokens + chunk, len(tokens))

    @precondition(lambda self: self.manager is not None and self.computed)
    @rule(data=st.data(), num_loaded=st.integers(0, 5))
    def step(self, data, num_loaded):
        rid = data.draw(st.sampled_from(sorted(self.computed)))
        tokens = self.tokens[rid]
        if self.computed[rid] < 0:  # the worker reported its load: confirm and match again
            grant = self.manager.serve_demand(BlockDemand(rid, 3, (), match_prefix=True,
                                                          num_remote_loaded_blocks=num_loaded))
            if grant is None:
                self._forget(rid)
            else:
                self.computed[rid] = min(grant.num_cached_tokens + 3, len(tokens))
            return
        new = ()
        if self.computed[rid] == len(tokens):  # decode: one more token
            tokens.append(7)
            new = (7,)
        target = min(self.computed[rid] + data.draw(st.integers(1, 6)), len(tokens))
        grant = self.manager.serve_demand(BlockDemand(rid, target, new))
        if grant is None:
            self._forget(rid)
        else:
            self.computed[rid] = target
            if self.remote is not None:  # the "worker" saves what the manager asks for
                self.remote.hashes.update(b.block_hash for b in self.manager.take_pending_saves())

    @precondition(lambda self: self.manager is not None and -1 in self.computed.values())
    @rule(data=st.data(), num_loaded=st.integers(0, 5))
    def remote_load_done(self, data, num_loaded):
        rid = data.draw(st.sampled_from(sorted(r for r, n in self.computed.items() if n < 0)))
        grant = self.manager.serve_demand(BlockDemand(rid, 3, (), match_prefix=True,
                                                      num_remote_loaded_blocks=num_loaded))
        if grant is None:
            self._forget(rid)
        else:
            assert not self.manager.requests[rid].is_remote_loading
            self.computed[rid] = min(grant.num_cached_tokens + 3, len(self.tokens[rid]))

    @precondition(lambda self: self.manager is not None and self.computed)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.computed)))
        self.manager.free_request(rid)
        self._forget(rid)

    def _forget(self, rid):
        self.computed.pop(rid, None)
        self.tokens.pop(rid, None)

    @invariant()
    def consistent(self):
        if self.manager is not None:
            self.manager.check_invariants()

    def teardown(self):
        if self.manager is None:
            return
        for rid in list(self.computed):
            self.manager.free_request(rid)
        self.manager.check_invariants()
        assert not self.manager.requests
        assert self.manager.num_free_blocks == self.manager.num_total_blocks
        if self.manager.swa is not None:
            swa = self.manager.swa
            assert swa.num_free_blocks + swa.num_reclaimable_blocks() == swa.num_total_blocks


TestCacheStateMachine = CacheMachine.TestCase
TestCacheStateMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
