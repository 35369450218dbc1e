"""Prefill/decode disaggregation in the step policy: a prefill node's sampling step sends the prompt's K/V; a
decode node's request waits outside the queues for its K/V, takes the first token as its first output, and its
first step installs the K/V and decodes from there."""

from __future__ import annotations

from ksana.config import BatchSchedulerSetting
from ksana.messages import KVArrived, KVInstall, KVSend, KVTransfer
from ksana.request import FinishReason, InferRequest, RequestStatus
from ksana.sampling_params import SamplingParams
from ksana.scheduler.batch_scheduler import BatchScheduler
from tests.scheduler.test_batch_scheduler import _grant_all


def _request(rid: str, num_prompt: int, role: str, transfer_id: int, max_tokens: int = 4) -> InferRequest:
    return InferRequest(request_id=rid, prompt_token_ids=list(range(1, num_prompt + 1)),
                        sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens), seed=0,
                        kv_transfer=KVTransfer(role, "p:1__d:2", transfer_id))


def _scheduler(chunk: int = 0) -> BatchScheduler:
    return BatchScheduler(BatchSchedulerSetting(split_fuse_token_num=chunk), 4, 100, 1000, kv_wait_s=5.0)


def _plan(scheduler: BatchScheduler, now: float = 0.0):
    out = scheduler.schedule(now)
    _grant_all(scheduler, out)
    scheduler.kv_transfers(out)
    rows = scheduler.build_rows(out)
    scheduler.commit(out)
    return out, rows


def test_the_prefill_node_sends_the_prompt_with_its_sampling_chunk_only():
    s = _scheduler(chunk=6)
    s.add_request(_request("r", 10, "prefill", 7, max_tokens=1))
    out, _ = _plan(s)
    assert out.kv_sends == ()  # the first chunk samples nothing
    out, _ = _plan(s)
    blocks = s.block_ids["r"]
    assert out.kv_sends == (KVSend("r", "p:1__d:2", 7, blocks, 10),)
    assert len(blocks) == 3  # 10 tokens: two full blocks and a partial one


def test_the_decode_node_waits_for_the_kv_then_installs_it_and_decodes_the_first_token():
    s = _scheduler()
    request = _request("r", 10, "decode", 7)
    assert s.add_request(request) is None
    assert s.schedule(0.0).scheduled == [] and not s.has_unfinished  # waiting for the K/V, outside the queues
    delta = s.kv_arrived(KVArrived(7, 55, 10, -0.25), now=0.1)
    assert delta.new_token_ids == (55,) and delta.new_logprobs == (-0.25,) and delta.finish_reason is None
    out, (row,) = _plan(s)
    assert row.token_ids == (55,) and row.start_position == 10 and row.do_sample
    assert out.kv_installs == (KVInstall("r", 7, s.block_ids["r"], 10),)
    assert len(s.block_ids["r"]) == 3  # positions 0..10
    out, _ = _plan(s)
    assert out.kv_installs == ()  # installed once


def test_kv_that_comes_before_its_request_is_kept_for_it():
    s = _scheduler()
    assert s.kv_arrived(KVArrived(9, 55, 6), now=0.0) is None
    delta = s.add_request(_request("r", 6, "decode", 9))
    assert delta.new_token_ids == (55,)
    out, _ = _plan(s)
    assert [i.request_id for i in out.kv_installs] == ["r"]


def test_a_first_token_that_ends_the_request_finishes_it_without_a_step():
    s = _scheduler()
    s.add_request(_request("r", 6, "decode", 9, max_tokens=1))
    delta = s.kv_arrived(KVArrived(9, 55, 6), now=0.0)
    assert delta.finish_reason == FinishReason.LENGTH.value
    assert not s.has_unfinished and "r" not in s.requests


def test_a_request_whose_kv_never_comes_ends_with_an_error_after_the_wait():
    s = _scheduler()
    request = _request("r", 6, "decode", 9)
    request.arrival_time = 1.0
    s.add_request(request)
    assert s.expire_kv_waits(now=5.5) == []
    (delta,) = s.expire_kv_waits(now=6.5)
    assert delta.finish_reason == FinishReason.ERROR.value and "within 5 s" in delta.error
    assert request.status is RequestStatus.FINISHED and "r" not in s.requests and not s.awaiting_kv


def test_an_aborted_request_stops_waiting_for_its_kv():
    s = _scheduler()
    s.add_request(_request("r", 6, "decode", 9))
    assert s.abort_request("r") is not None
    assert not s.awaiting_kv
    assert s.kv_arrived(KVArrived(9, 55, 6), now=0.0) is None  # kept unclaimed, then forgotten
    assert s.expire_kv_waits(now=10.0) == []


def test_kv_of_another_length_than_the_prompt_is_an_error():
    s = _scheduler()
    s.add_request(_request("r", 6, "decode", 9))
    delta = s.kv_arrived(KVArrived(9, 55, 8), now=0.0)
    assert delta.finish_reason == FinishReason.ERROR.value and "8 tokens for a prompt of 6" in delta.error


def test_kv_the_connector_refused_ends_the_request_with_its_reason():
    s = _scheduler()
    s.add_request(_request("r", 6, "decode", 9))
    delta = s.kv_arrived(KVArrived(9, 55, 6, error="the prefill node's KV cache does not fit"), now=0.0)
    assert delta.finish_reason == FinishReason.ERROR.value and delta.error == "the prefill node's KV cache does not fit"
    assert not s.has_unfinished and "r" not in s.requests
