"""The load generator ``ksana.bench.serve`` (``ksana bench serve``) against the demo server: its counts, timings and arrival processes."""

from __future__ import annotations

import statistics
from pathlib import Path

import orjson
import pytest

from ksana.bench import serve


@pytest.fixture(scope="module")
def bench():
    return serve


def test_random_dataset_run_counts_every_token(server, bench, tmp_path: Path):
    out = tmp_path / "serve.json"
    assert bench.main(["--base-url", server.url, "--num-prompts", "12", "--input-len", "4:24", "--output-len", "2:9",
                       "--max-concurrency", "4", "--goodput", "ttft:600000", "tpot:600000",
                       "--result-file", str(out)]) == 0
    result = orjson.loads(out.read_bytes())
    vocab_size = server.client.get("/v1/models").json()["data"][0]["vocab_size"]
    workload = bench.random_dataset(12, (4, 24), (2, 9), vocab_size, 0)
    assert result["completed"] == 12 and result["failed"] == 0
    assert result["total_input_tokens"] == sum(r.prompt_len for r in workload)
    assert result["total_output_tokens"] == sum(r.output_len for r in workload)  # ignore_eos: exactly as asked
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    for request in result["requests"]:
        assert request["success"]
        assert 1 <= len(request["itl"]) + 1 <= request["output_len"]  # a chunk per step (or per catch-up)
        assert request["ttft"] <= request["e2el"]
        assert request["tpot"] == pytest.approx((request["e2el"] - request["ttft"]) / (request["output_len"] - 1))
    # The summary's statistics are those of the per-request timings (p99 as numpy's linear interpolation).
    ttft_ms = [1000 * r["ttft"] for r in result["requests"]]
    e2el_ms = [1000 * r["e2el"] for r in result["requests"]]
    itl_ms = [1000 * gap for r in result["requests"] for gap in r["itl"]]
    assert result["mean_ttft_ms"] == pytest.approx(statistics.fmean(ttft_ms))
    assert result["mean_e2el_ms"] == pytest.approx(statistics.fmean(e2el_ms))
    assert result["median_itl_ms"] == pytest.approx(statistics.median(itl_ms))
    assert result["p99_itl_ms"] == pytest.approx(statistics.quantiles(itl_ms, n=100, method="inclusive")[98])


def test_trace_replay_keeps_its_arrival_times(server, bench, tmp_path: Path):
    trace = tmp_path / "trace.jsonl"
    rows = [{"prompt_token_ids": [5, 6, 7, 8], "output_len": 3, "timestamp": 0.0},
            {"prompt": "hello there", "output_len": 2, "timestamp": 0.3},
            {"prompt_token_ids": [9, 10], "max_tokens": 4, "timestamp": 0.6}]
    trace.write_text("\n".join(orjson.dumps(r).decode() for r in rows) + "\n")
    out = tmp_path / "trace.json"
    assert bench.main(["--base-url", server.url, "--dataset", str(trace), "--endpoint", "/generate",
                       "--result-file", str(out)]) == 0
    result = orjson.loads(out.read_bytes())
    assert result["completed"] == 3 and result["total_output_tokens"] == 9
    sends = [r["send_time"] for r in result["requests"]]
    for sent, row in zip(sends, rows, strict=True):  # none leaves before its time in the trace
        assert sent >= row["timestamp"]


def test_arrivals_are_poisson_or_gamma_at_the_asked_rate(bench):
    for burstiness, coefficient_of_variation in ((1.0, 1.0), (0.25, 2.0), (4.0, 0.5)):
        times = bench.arrival_times(20_000, 4.0, burstiness, seed=0)
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.05)
        assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(coefficient_of_variation, rel=0.08)
    assert bench.arrival_times(5, float("inf"), 1.0, seed=0) == [0.0] * 5


def test_a_rejected_request_is_a_failure_with_the_servers_status_and_message(server, bench):
    import time

    import trio

    result = bench.RequestResult(prompt_len=1)
    body = {"model": "no-such-model", "prompt": "hi", "max_tokens": 2, "stream": True}
    trio.run(bench.send_one, bench.Target.parse(server.url), "/v1/completions", body, result, time.perf_counter(), 60)
    assert not result.success
    assert result.error.startswith("HTTP 404") and "no-such-model" in result.error


def test_a_request_past_its_timeout_is_a_failure_that_says_so(server, bench):
    import time

    import trio

    result = bench.RequestResult(prompt_len=1)
    body = bench.request_body("/v1/completions", "demo", bench.BenchRequest([5, 6, 7], 3, 64), True)
    trio.run(bench.send_one, bench.Target.parse(server.url), "/v1/completions", body, result, time.perf_counter(), 0)
    assert not result.success and result.error == "timed out after 0 s"


def test_the_target_takes_the_base_urls_host_port_and_path_and_refuses_other_schemes(bench):
    target = bench.Target.parse("http://127.0.0.1:8123/prefix/", api_key="k")
    assert (target.host, target.port, target.prefix) == ("127.0.0.1", 8123, "/prefix")
    assert ("Host", "127.0.0.1:8123") in target.headers and ("Authorization", "Bearer k") in target.headers
    with pytest.raises(SystemExit, match="--base-url must be http://"):
        bench.Target.parse("https://example.com")
