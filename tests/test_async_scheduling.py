"""Async scheduling on a real engine (the demo model): while requests wait, the worker is handed step N+1 while step
N runs, and the outputs are the ones one step in flight gives, penalties, seeds, stops and logprobs included."""

from __future__ import annotations

import threading

import pytest

from ksana import LLM, SamplingParams

PROMPTS = ["the quick brown fox", "hello", "a much longer prompt about cats and dogs and the weather today", "x y"]


@pytest.fixture(scope="module")
def engines():
    pipelined = LLM(model="demo", block_token_num=8, max_batch_size=16)
    one_in_flight = LLM(model="demo", block_token_num=8, max_batch_size=16, async_scheduling=False)
    return pipelined, one_in_flight


def _mixed_params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[5, 17, 33, 48], logprobs=3),
        SamplingParams(temperature=0.9, seed=11, max_tokens=24, repetition_penalty=1.3, presence_penalty=0.4,
                       frequency_penalty=0.3, min_tokens=6),
        SamplingParams(temperature=1.0, top_p=0.8, seed=5, max_tokens=18, stop=["e"], n=2),
        SamplingParams(temperature=0.0, max_tokens=30, repetition_penalty=1.5, ignore_eos=True),
    ]


def test_outputs_equal_those_of_one_step_in_flight(engines):
    pipelined, one_in_flight = engines
    assert pipelined.engine.scheduler.setting.async_scheduling
    assert not one_in_flight.engine.scheduler.setting.async_scheduling
    params = _mixed_params()
    runner, execute = pipelined.engine.runner, pipelined.engine.runner.execute
    calls = {"started": 0, "ended": 0}

    def counting_execute(plan):
        calls["started"] += 1
        result = execute(plan)
        calls["ended"] += 1
        return result

    runner.execute = counting_execute
    try:
        got = pipelined.generate(PROMPTS, params, use_tqdm=False)
    finally:
        del runner.execute
    # A request that stopped had its next step in flight: generate waited for it before returning.
    assert calls["started"] == calls["ended"] > 0
    want = one_in_flight.generate(PROMPTS, params, use_tqdm=False)
    finish_reasons = set()
    for g, w in zip(got, want, strict=True):
        assert len(g.outputs) == len(w.outputs)
        for a, b in zip(g.outputs, w.outputs, strict=True):
            assert a.token_ids == b.token_ids and a.text == b.text and a.finish_reason == b.finish_reason
            finish_reasons.add(a.finish_reason)
            if b.logprobs is not None:
                assert [sorted(x) for x in a.logprobs] == [sorted(x) for x in b.logprobs]
    assert {"stop", "length"} <= finish_reasons, "both ways of finishing are exercised"
    # Every block is back after the run, in both engines (a finished request's last step in flight included).
    for llm in engines:
        assert llm.engine.cache_manager.num_free_blocks == llm.engine.num_blocks


def test_the_worker_is_handed_the_next_step_while_one_runs_and_a_request_waits():
    """One request at a time, two requests. While the second waits, each of the first's steps blocks on the lane
    until the next step's plan is queued behind it (with one step in flight that would never happen, so the test
    would fail on the wait, not hang). Once nothing waits, the next step is planned only after a step ends."""
    llm = LLM(model="demo", block_token_num=8, max_batch_size=1)
    lane, runner = llm.engine.forward_lane, llm.engine.runner
    submitted: dict[int, threading.Event] = {}
    queued_before_end: list[bool] = []
    submit, execute = lane.submit, runner.execute
    num_tokens = 6
    first_last_step = num_tokens - 1  # steps count from 0: a prefill, then a decode per token but the first
    last_step = 2 * num_tokens - 1

    def recording_submit(fn, plan):
        submitted.setdefault(plan.step_id, threading.Event()).set()
        return submit(fn, plan)

    def waiting_execute(plan):
        result = execute(plan)
        if plan.step_id < last_step:
            following = submitted.setdefault(plan.step_id + 1, threading.Event())
            queued_before_end.append(following.wait(timeout=60) if plan.step_id < first_last_step
                                     else following.is_set())
        return result

    lane.submit, runner.execute = recording_submit, waiting_execute
    try:
        params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
        out = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    finally:
        del lane.submit, runner.execute
    assert [len(o.outputs[0].token_ids) for o in out] == [num_tokens] * 2
    assert sorted(submitted) == list(range(last_step + 1)), "no step past the known last token"
    # the first request's steps but its last (the second cannot join a full batch before it ends), then none
    assert queued_before_end == [True] * (num_tokens - 1) + [False] * num_tokens
