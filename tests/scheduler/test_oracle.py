"""The real scheduler and cache manager under random arrivals, chunking, preemption and aborts, checked against
the KV-hash oracle: every request's tokens must equal what the plain token list implies."""

from __future__ import annotations

import random

import pytest

from ksana.config import BatchSchedulerSetting
from tests.kv_hash_oracle import expected_tokens
from tests.scheduler.harness import Arrival, random_arrivals, run_workload


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_arrivals_with_chunking_and_preemption_match_oracle(seed, async_scheduling):
    arrivals = random_arrivals(random.Random(seed), num=40)
    setting = BatchSchedulerSetting(max_batch_size=6, max_step_tokens=32, split_fuse_token_num=8,
                                    async_scheduling=async_scheduling)
    run = run_workload(arrivals, setting, num_blocks=40, block_size=4)
    assert (run.worker.num_placeholder_rows > 0) == async_scheduling

    for arrival in arrivals:
        result = run.results[arrival.request_id]
        assert result.finish_reason == "length", (arrival.request_id, result.error)
        assert result.tokens == expected_tokens(arrival.prompt, arrival.max_tokens), arrival.request_id
    assert run.scheduler.stats.num_preemptions > 0, "the pool was meant to be small enough to preempt"
    assert run.worker.num_chunked_rows > 0, "prompts longer than split_fuse_token_num must be chunked"
    assert run.worker.max_rows <= setting.max_batch_size
    assert run.stats_after.num_free_blocks == run.stats_after.num_total_blocks
    assert run.stats_after.num_requests_with_blocks == 0


def test_without_chunking_prompts_run_whole_and_match_oracle():
    arrivals = random_arrivals(random.Random(7), num=25, max_prompt=50)
    setting = BatchSchedulerSetting(max_batch_size=8, max_step_tokens=64, split_fuse_token_num=0)
    run = run_workload(arrivals, setting, num_blocks=64, block_size=8)
    for arrival in arrivals:
        assert run.results[arrival.request_id].tokens == expected_tokens(arrival.prompt, arrival.max_tokens)
    assert run.worker.num_chunked_rows == 0
    assert run.stats_after.num_free_blocks == run.stats_after.num_total_blocks


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_aborts_free_every_block_and_the_rest_still_match(async_scheduling):
    arrivals = random_arrivals(random.Random(3), num=40, abort_fraction=0.4)
    setting = BatchSchedulerSetting(max_batch_size=5, max_step_tokens=24, split_fuse_token_num=6,
                                    async_scheduling=async_scheduling)
    run = run_workload(arrivals, setting, num_blocks=36, block_size=4)
    num_aborted = 0
    for arrival in arrivals:
        result = run.results[arrival.request_id]
        expected = expected_tokens(arrival.prompt, arrival.max_tokens)
        if result.finish_reason == "abort":
            num_aborted += 1
            assert result.tokens == expected[: len(result.tokens)]
        else:
            assert result.tokens == expected
    assert num_aborted > 0
    assert run.stats_after.num_free_blocks == run.stats_after.num_total_blocks
    assert run.stats_after.num_requests_with_blocks == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stop_tokens_end_requests_whose_next_step_is_already_in_flight(async_scheduling):
    """With async scheduling a request that samples a stop token already has its next step in flight: that step's
    token is dropped, nothing more is sent for the request, and its blocks come back."""
    stop = tuple(range(1, 60))  # about one token in seventeen
    arrivals = random_arrivals(random.Random(4), num=40, max_new=40)
    setting = BatchSchedulerSetting(max_batch_size=6, max_step_tokens=32, split_fuse_token_num=8,
                                    async_scheduling=async_scheduling)
    run = run_workload(arrivals, setting, num_blocks=40, block_size=4, stop_token_ids=stop)
    num_stopped = 0
    for arrival in arrivals:
        result = run.results[arrival.request_id]
        expected = expected_tokens(arrival.prompt, arrival.max_tokens)
        end = next((i + 1 for i, t in enumerate(expected) if t in stop), len(expected))
        assert result.tokens == expected[:end], arrival.request_id
        assert result.finish_reason == ("stop" if expected[end - 1] in stop else "length"), arrival.request_id
        num_stopped += result.finish_reason == "stop"
    assert num_stopped >= 10
    assert run.scheduler.stats.num_preemptions > 0
    assert run.stats_after.num_free_blocks == run.stats_after.num_total_blocks
    assert run.stats_after.num_requests_with_blocks == 0


def test_full_waiting_queue_rejects_with_a_clear_error():
    arrivals = [Arrival(0.0, f"q{i}", [5, 6, 7], 20) for i in range(5)]
    setting = BatchSchedulerSetting(max_batch_size=1, max_step_tokens=64, max_waiting_queue_len=2)
    run = run_workload(arrivals, setting, num_blocks=32, block_size=4)
    rejected = [r for r in run.results.values() if r.finish_reason == "error"]
    assert len(rejected) >= 1
    assert all("waiting queue is full" in r.error for r in rejected)
    served = [a for a in arrivals if run.results[a.request_id].finish_reason == "length"]
    assert served and all(run.results[a.request_id].tokens == expected_tokens(a.prompt, 20) for a in served)


def test_waiting_timeout_rejects_requests_that_waited_too_long():
    # One slot; the first request holds it for 30 steps of 0.1 s of virtual time.
    arrivals = [Arrival(0.0, "long", [1, 2, 3], 30), Arrival(0.01, "late", [4, 5], 3)]
    setting = BatchSchedulerSetting(max_batch_size=1, max_step_tokens=64, waiting_timeout_in_ms=500)
    run = run_workload(arrivals, setting, num_blocks=32, block_size=4, step_latency=lambda plan: 0.1)
    assert run.results["long"].finish_reason == "length"
    assert run.results["late"].finish_reason == "error"
    assert "waiting_timeout_in_ms=500" in run.results["late"].error
    assert run.stats_after.num_free_blocks == run.stats_after.num_total_blocks


def test_prompt_longer_than_max_token_len_is_rejected():
    arrivals = [Arrival(0.0, "big", list(range(1, 40)), 4), Arrival(0.0, "ok", [1, 2], 4)]
    setting = BatchSchedulerSetting(max_batch_size=4, max_step_tokens=64)
    run = run_workload(arrivals, setting, num_blocks=32, block_size=4, max_token_len=32)
    assert run.results["big"].finish_reason == "error"
    assert "maximum is 31" in run.results["big"].error
    assert run.results["ok"].tokens == expected_tokens([1, 2], 4)


def test_generation_stops_at_max_token_len():
    arrivals = [Arrival(0.0, "a", [1, 2, 3, 4, 5], 100)]
    setting = BatchSchedulerSetting(max_batch_size=4, max_step_tokens=64)
    run = run_workload(arrivals, setting, num_blocks=32, block_size=4, max_token_len=12)
    assert run.results["a"].finish_reason == "length"
    assert run.results["a"].tokens == expected_tokens([1, 2, 3, 4, 5], 7)
