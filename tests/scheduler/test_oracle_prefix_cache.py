"""The KV-hash oracle with the prefix cache on: shared prefixes, chunking, preemption, aborts and (with a sliding
layer) SWA blocks, checked token for token; a wrong reuse of a cached block changes what the oracle reads back."""

from __future__ import annotations

import random

import pytest

from ksana.config import BatchSchedulerSetting
from tests.kv_hash_oracle import expected_tokens
from tests.scheduler.harness import random_arrivals, random_arrivals_with_shared_prefixes, run_workload


def _check(run, arrivals, window=None):
    for arrival in arrivals:
        result = run.results[arrival.request_id]
        expected = expected_tokens(arrival.prompt, arrival.max_tokens, window)
        if result.finish_reason == "abort":
            assert result.tokens == expected[: len(result.tokens)], arrival.request_id
        else:
            assert result.finish_reason == "length", (arrival.request_id, result.error)
            assert result.tokens == expected, arrival.request_id
    assert run.stats_after.num_free_blocks == run.stats_after.num_total_blocks
    assert run.stats_after.num_requests_with_blocks == 0
    run.manager.check_invariants()


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_shared_prefixes_hit_and_match_oracle(seed, async_scheduling):
    arrivals = random_arrivals_with_shared_prefixes(random.Random(seed), num=40)
    setting = BatchSchedulerSetting(max_batch_size=6, max_step_tokens=32, split_fuse_token_num=8,
                                    enable_auto_prefix_cache=True, async_scheduling=async_scheduling)
    run = run_workload(arrivals, setting, num_blocks=40, block_size=4)
    _check(run, arrivals)
    assert run.stats_after.prefix_cache_hit_token_num > 0
    assert run.stats_after.full_prompt_matched_req_num > 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prefix_cache_under_preemption_without_chunking(async_scheduling):
    arrivals = random_arrivals_with_shared_prefixes(random.Random(5), num=30, max_prefix=30, max_new=40)
    setting = BatchSchedulerSetting(max_batch_size=8, max_step_tokens=64, enable_auto_prefix_cache=True,
                                    async_scheduling=async_scheduling)
    run = run_workload(arrivals, setting, num_blocks=16, block_size=4)
    _check(run, arrivals)
    assert run.scheduler.stats.num_preemptions > 0
    assert run.stats_after.prefix_cache_hit_token_num > 0


def test_prefix_cache_on_random_prompts_with_aborts_matches_oracle():
    arrivals = random_arrivals(random.Random(3), num=40, abort_fraction=0.4)
    setting = BatchSchedulerSetting(max_batch_size=5, max_step_tokens=24, split_fuse_token_num=6,
                                    enable_auto_prefix_cache=True)
    run = run_workload(arrivals, setting, num_blocks=36, block_size=4)
    _check(run, arrivals)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize(("window", "num_swa_blocks"), [(6, 0), (9, 14)])
def test_sliding_window_prefix_cache_matches_oracle(window, num_swa_blocks, async_scheduling):
    # num_swa_blocks=14 < the FA pool: cached SWA blocks get evicted, so hits must respect the window condition.
    arrivals = random_arrivals_with_shared_prefixes(random.Random(11), num=40, max_prefix=36)
    setting = BatchSchedulerSetting(max_batch_size=4, max_step_tokens=32, split_fuse_token_num=8,
                                    enable_auto_prefix_cache=True, async_scheduling=async_scheduling)
    run = run_workload(arrivals, setting, num_blocks=48, block_size=4, sliding_window=window,
                       num_swa_blocks=num_swa_blocks)
    _check(run, arrivals, window)
    assert run.stats_after.prefix_cache_hit_token_num > 0
    if num_swa_blocks:
        assert run.manager.swa.num_evictions > 0
