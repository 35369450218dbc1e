"""Faults and operations: metrics, a client leaving mid-stream, API keys, a full queue, SIGINT/SIGTERM."""

from __future__ import annotations

import signal
import sys
import threading

import httpx2
import openai
import pytest

from tests.server.conftest import ServerProcess

# Up to the demo model's 2048-token context: ~2000 tokens, long enough to still run when a test acts on it.
LONG = {"prompt": "Once upon a time", "max_tokens": 2000, "extra_body": {"ignore_eos": True}}
KEY = "sk-test-key"
# One running request at a time and one waiting: the next one finds the queue full.
SMALL_QUEUE = ("--model", "demo", "--max-batch-size", "1", "--max-waiting-queue-len", "1")


@pytest.fixture(scope="module")
def small_servers():
    """Two servers started together so their start-ups overlap. The keyed one serves the key and queue tests and
    then meets SIGINT (the last test of this module); the other meets SIGTERM."""
    processes = {"keyed": ServerProcess(*SMALL_QUEUE, "--api-key", KEY), signal.SIGTERM: ServerProcess(*SMALL_QUEUE)}
    processes[signal.SIGINT] = processes["keyed"]
    try:
        yield {name: p.wait_ready() for name, p in processes.items()}
    finally:
        for p in {id(p): p for p in processes.values()}.values():
            p.close()


def test_metrics_follow_requests(server):
    before = server.metrics()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    result = client.completions.create(model="demo", prompt="hello there", max_tokens=7, temperature=0,
                                       extra_body={"ignore_eos": True})
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="demo", prompt="fox " * 3000)  # refused before the engine: not counted
    after = server.metrics()

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert grew("forward_req_total_num_total") == 1
    assert grew("time_to_first_token_us_count") == 1
    assert grew("inter_token_interval_latency_us_count") == 6
    assert grew("total_latency_us_count") == 1
    assert grew("input_token_len_sum") == result.usage.prompt_tokens
    assert grew("output_token_len_sum") == 7
    assert grew("forward_req_error_num_total") == 0 and grew("forward_req_aborted_num_total") == 0
    # The first token's latency and the gaps after it add up to the time of the last token, which came no later
    # than the request's end (1 us of slack for the float sums).
    streamed_us = grew("time_to_first_token_us_sum") + grew("inter_token_interval_latency_us_sum")
    assert streamed_us <= grew("total_latency_us_sum") + 1
    for name in ("batch_scheduler_batch_size", "batch_scheduler_waiting_size", "block_manager_free_block_num",
                 "block_manager_used_block_num", "block_manager_total_block_num"):
        assert name in after
    assert after["block_manager_free_block_num"] == after["block_manager_total_block_num"]


def test_client_leaving_mid_stream_frees_its_blocks(server):
    aborted = server.metrics()["forward_req_aborted_num_total"]
    with httpx2.Client(base_url=server.url, timeout=30) as client:
        body = {"prompt": LONG["prompt"], "max_tokens": LONG["max_tokens"], "ignore_eos": True, "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            held = server.wait_metrics(lambda m: m["block_manager_used_block_num"] > 0)
            assert held["block_manager_request_num"] == 1
        # Leaving the block closes the connection with most of the ~2000 tokens still to come.
    after = server.wait_metrics(lambda m: m["block_manager_used_block_num"] == 0)
    assert after["block_manager_request_num"] == 0
    assert after["forward_req_aborted_num_total"] == aborted + 1
    assert server.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_api_key(small_servers):
    server = small_servers["keyed"]
    with openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError) as info:
            client.models.list()
        assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
    missing = httpx2.post(server.url + "/generate", json={"prompt": "hi"})  # no key at all
    assert missing.status_code == 401 and set(missing.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx2.get(server.url + "/health").status_code == 200  # health and metrics stay open
    assert httpx2.get(server.url + "/metrics").status_code == 200
    with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as client:
        assert client.completions.create(model="demo", prompt="hi", max_tokens=2).usage.completion_tokens == 2


def _wait_for_waiting(server: ServerProcess, num: int) -> None:
    server.wait_metrics(lambda m: m["batch_scheduler_waiting_size"] == num)


def test_full_queue_is_503_and_the_server_recovers(small_servers):
    server = small_servers["keyed"]
    headers = {"Authorization": f"Bearer {KEY}"}
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    running = client.completions.create(model="demo", stream=True, **LONG)
    next(iter(running))  # admitted and streaming: the one running slot is taken
    waiting: dict[str, httpx2.Response] = {}
    thread = threading.Thread(target=lambda: waiting.update(r=httpx2.post(
        server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, headers=headers, timeout=60)))
    thread.start()
    _wait_for_waiting(server, 1)
    errors = server.metrics()["forward_req_error_num_total"]
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model="demo", prompt="one too many", max_tokens=3)
    assert info.value.status_code == 503 and info.value.body["code"] == "queue_full"
    assert "waiting queue is full" in info.value.body["message"]
    server.wait_metrics(lambda m: m["forward_req_error_num_total"] == errors + 1)  # the refusal is counted once
    running.close()  # the long request leaves; the waiting one runs
    thread.join(30)
    assert waiting["r"].status_code == 200 and waiting["r"].json()["usage"]["completion_tokens"] == 3
    assert client.completions.create(model="demo", prompt="hi", max_tokens=2).usage.completion_tokens == 2
    client.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_stop_signal_ends_streams_with_an_error_and_exits_0(small_servers, sig):
    server = small_servers[sig]
    headers = {"Authorization": f"Bearer {KEY}"}
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    stream = iter(client.completions.create(model="demo", stream=True, **LONG))
    next(stream)
    queued: dict[str, httpx2.Response] = {}
    thread = threading.Thread(target=lambda: queued.update(r=httpx2.post(
        server.url + "/generate", json={"prompt": "hi", "sampling_config": {"max_new_tokens": 3}}, headers=headers,
        timeout=60)))
    thread.start()
    _wait_for_waiting(server, 1)

    server.proc.send_signal(sig)
    with pytest.raises(openai.APIError, match="shutting down"):
        for _ in stream:
            pass
    thread.join(10)
    assert queued["r"].status_code == 503  # never admitted: an error status, not a broken stream
    assert queued["r"].json()["error"]["code"] == "server_shutting_down"
    assert server.proc.wait(timeout=30) == 0  # the timeout only stops a server that never exits
    client.close()


def test_serving_runs_with_a_short_switch_interval_and_restores_the_interpreters():
    from ksana.server.serve import ServeOptions, switch_interval

    before = sys.getswitchinterval()
    assert ServeOptions().switch_interval_s < before  # shorter than CPython's 5 ms default
    with switch_interval(ServeOptions().switch_interval_s):
        assert sys.getswitchinterval() == pytest.approx(ServeOptions().switch_interval_s)
    assert sys.getswitchinterval() == before
