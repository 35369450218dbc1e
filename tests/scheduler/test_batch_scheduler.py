"""The step policy alone: budget, batch size, order, chunking and who gets preempted."""

from __future__ import annotations

from ksana.config import BatchSchedulerSetting
from ksana.messages import SampledToken, StepBlocks
from ksana.request import InferRequest, RequestStatus
from ksana.sampling_params import SamplingParams
from ksana.scheduler.batch_scheduler import BatchScheduler


def _request(rid: str, num_prompt: int, max_tokens: int = 8) -> InferRequest:
    return InferRequest(request_id=rid, prompt_token_ids=list(range(1, num_prompt + 1)),
                        sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens), seed=0)


def _grant_all(scheduler: BatchScheduler, out) -> None:
    """Stand in for the cache manager: hand out consecutive fake block ids for what the plan needs."""
    tables = {}
    used = sum(len(t) for t in scheduler.block_ids.values())
    next_id = used
    for demand in scheduler.block_demands(out):
        have = list(scheduler.block_ids.get(demand.request_id, ()))
        while len(have) * scheduler.block_size < demand.num_tokens:
            have.append(next_id)
            next_id += 1
        tables[demand.request_id] = tuple(have)
    free = scheduler.num_total_blocks - sum(len(t) for t in {**scheduler.block_ids, **tables}.values())
    scheduler.apply_blocks(out, StepBlocks(block_tables=tables, refused=(), num_free_blocks=free))


def _step(scheduler: BatchScheduler, now: float = 0.0):
    out = scheduler.schedule(now)
    _grant_all(scheduler, out)
    scheduler.commit(out)
    sampled = {s.request.request_id: SampledToken(99, 0.0) for s in out.scheduled if s.do_sample}
    scheduler.update(out, sampled)
    return out


def test_token_budget_and_fifo_admission():
    s = BatchScheduler(BatchSchedulerSetting(max_step_tokens=10, max_batch_size=8, split_fuse_token_num=0), 4, 100,
                       1000)
    for rid, n in [("a", 4), ("b", 5), ("c", 3)]:
        s.add_request(_request(rid, n))
    out = _step(s)
    # a (4) + b (5) fit in 10; c (3), whole, would exceed it, and FIFO stops at the first misfit.
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 4), ("b", 5)]
    out = _step(s)
    # Running requests decode first (1 token each), then c is admitted.
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 1), ("c", 3)]


def test_by_default_a_prompt_that_does_not_fit_fills_what_is_left_of_the_budget():
    s = BatchScheduler(BatchSchedulerSetting(max_step_tokens=10, max_batch_size=8), 4, 100, 1000)
    for rid, n in [("a", 4), ("b", 5), ("c", 3)]:
        s.add_request(_request(rid, n))
    out = _step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 4), ("b", 5), ("c", 1)]
    out = _step(s)
    # c's last two prompt tokens run beside the others' decode rows
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 1), ("c", 2)]


def test_max_batch_size_caps_running_requests():
    s = BatchScheduler(BatchSchedulerSetting(max_step_tokens=100, max_batch_size=2), 4, 100, 1000)
    for rid in "abc":
        s.add_request(_request(rid, 2))
    out = _step(s)
    assert [x.request.request_id for x in out.scheduled] == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c"]


def test_chunked_prefill_splits_long_prompts_and_samples_only_at_the_end():
    s = BatchScheduler(BatchSchedulerSetting(max_step_tokens=100, split_fuse_token_num=4), 4, 100, 1000)
    s.add_request(_request("a", 10))
    chunks = []
    for _ in range(3):
        out = _step(s)
        chunks.append((out.scheduled[0].num_new_tokens, out.scheduled[0].do_sample))
    assert chunks == [(4, False), (4, False), (2, True)]
    assert s.requests["a"].output_token_ids == [99]


def test_newest_running_request_is_preempted_when_blocks_run_out():
    # 6 blocks of 2 tokens: a, b, c each take 2 blocks for 3 prompt tokens + room.
    s = BatchScheduler(BatchSchedulerSetting(max_step_tokens=100, max_batch_size=8), 2, 6, 1000)
    for rid in "abc":
        s.add_request(_request(rid, 4, max_tokens=20))
    _step(s)  # each holds 2 blocks (4 tokens); the pool is full
    out = s.schedule(1.0)
    assert [r.request_id for r in out.preempted] == ["c"]
    assert [x.request.request_id for x in out.scheduled] == ["a", "b"]
    c = s.waiting[0]
    assert c.request_id == "c" and c.status is RequestStatus.WAITING and c.num_computed_tokens == 0
    assert c.num_tokens == 5  # prompt + its one generated token, recomputed later


def test_eos_stops_unless_ignored_and_not_before_min_tokens():
    s = BatchScheduler(BatchSchedulerSetting(), 4, 100, 1000)
    plain = _request("plain", 3, max_tokens=8)
    ignoring = _request("ignoring", 3, max_tokens=8)
    ignoring.sampling_params.ignore_eos = True
    early = InferRequest(request_id="early", prompt_token_ids=[1, 2], seed=0,
                         sampling_params=SamplingParams(temperature=0.0, max_tokens=8, min_tokens=2))
    for request in (plain, ignoring, early):
        request.eos_token_ids = (99,)
        s.add_request(request)
    assert early.banned_token_ids() == (99,)
    _step(s)  # every request samples 99, the EOS
    assert plain.finish_reason.value == "stop" and plain.output_token_ids == [99]
    assert ignoring.finish_reason is None and early.finish_reason is None
    assert early.banned_token_ids() == (99,)
    _step(s)
    assert early.finish_reason.value == "stop" and early.output_token_ids == [99, 99]
    assert early.banned_token_ids() == ()
    assert ignoring.finish_reason is None
