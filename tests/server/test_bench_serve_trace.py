"""``ksana bench serve --trace``: the simulator's trace replayed against a real server, latencies counted from each
request's scheduled arrival."""

from __future__ import annotations

import re
from pathlib import Path

import orjson
import pytest

from ksana.bench import serve
from ksana.bench.trace import TraceRequest, write_trace


def test_trace_requests_get_their_lengths_and_count_from_their_arrival(server, tmp_path: Path):
    trace = write_trace(tmp_path / "trace.jsonl", [TraceRequest(0.0, 12, 6), TraceRequest(0.0, 9, 5),
                                                   TraceRequest(0.5, 3, 4, (20, 21, 22))])
    out = tmp_path / "result.json"
    # One request in flight at a time: the second waits for the first, and that wait is part of its latency.
    assert serve.main(["--base-url", server.url, "--trace", str(trace), "--max-concurrency", "1",
                       "--result-file", str(out)]) == 0
    result = orjson.loads(out.read_bytes())
    first, second, third = result["requests"]
    assert [r["prompt_len"] for r in result["requests"]] == [12, 9, 3]
    assert [r["output_len"] for r in result["requests"]] == [6, 5, 4]  # ignore_eos: each gets its length
    assert result["dataset"] == str(trace) and result["completed"] == 3
    assert second["send_time"] >= first["e2el"]  # sent once the first was done ...
    assert second["ttft"] >= first["e2el"]  # ... and its time to first token counts from its arrival at 0
    assert third["send_time"] >= 0.5


def test_a_malformed_trace_is_refused_before_any_request(server, tmp_path: Path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"arrival_time_s": 0, "prompt_len": 4, "output_len": 0}\n')
    with pytest.raises(ValueError, match=re.escape(f"{trace}:1: 'output_len' must be a whole number >= 1, got 0")):
        serve.main(["--base-url", server.url, "--trace", str(trace), "--result-file", str(tmp_path / "r.json")])
    assert not (tmp_path / "r.json").exists()
