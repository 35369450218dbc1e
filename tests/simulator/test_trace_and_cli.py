"""The shared trace format, the profiling sweep and ``ksana simulate`` as a user runs it, bad input included."""

from __future__ import annotations

import re
import subprocess
import sys

import orjson
import pytest

from ksana.bench.trace import TraceRequest, prompt_ids, read_trace, synthetic_trace, write_trace
from ksana.simulator.sweep import sweep_batches
from tests.simulator.fits import demo_identity, linear_fit


@pytest.mark.parametrize("lines, message", [
    ([], ": no requests"),
    (['{"arrival_time_s": 0, "prompt_len": 4}'], ":1: missing 'output_len'"),
    (['{"arrival_time_s": -1, "prompt_len": 4, "output_len": 2}'], ":1: 'arrival_time_s' must be a number >= 0"),
    (['{"arrival_time_s": 2, "prompt_len": 4, "output_len": 2}', '{"arrival_time_s": 1, "prompt_len": 4, '
      '"output_len": 2}'], ":2: 'arrival_time_s' 1 is before the line above's 2"),
    (['{"arrival_time_s": 0, "prompt_len": 0, "output_len": 2}'], ":1: 'prompt_len' must be a whole number >= 1"),
    (['{"arrival_time_s": 0, "prompt_len": 3, "output_len": 2, "prompt_token_ids": [1, 2]}'],
     ":1: 'prompt_token_ids' has 2 ids, 'prompt_len' says 3"),
    (["[1, 2]"], ":1: expected an object"),
    (["{oops"], ":1: not JSON"),
])
def test_a_malformed_trace_names_its_line(tmp_path, lines, message):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + ("\n" if lines else ""))
    with pytest.raises(ValueError, match=re.escape(f"{path}{message}")):
        read_trace(path)


def test_a_trace_round_trips_and_prompts_are_the_same_for_every_reader(tmp_path):
    requests = synthetic_trace(50, 4.0, (8, 64), (4, 32), burstiness=0.5, seed=3)
    requests.append(TraceRequest(requests[-1].arrival_time_s + 1, 3, 2, (7, 8, 9)))
    assert read_trace(write_trace(tmp_path / "t.jsonl", requests)) == requests
    arrivals = [r.arrival_time_s for r in requests]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    assert all(8 <= r.prompt_len <= 64 and 4 <= r.output_len <= 32 for r in requests[:-1])
    assert prompt_ids(requests[0], 0, 1000, seed=1) == prompt_ids(requests[0], 0, 1000, seed=1)
    assert prompt_ids(requests[0], 0, 1000, seed=1) != prompt_ids(requests[0], 1, 1000, seed=1)
    assert len(prompt_ids(requests[5], 5, 1000)) == requests[5].prompt_len
    assert prompt_ids(requests[-1], 50, 1000) == [7, 8, 9]


def test_burstiness_shapes_the_gaps():
    def spread(burstiness):
        times = [r.arrival_time_s for r in synthetic_trace(2000, 10.0, (1, 1), (1, 1), burstiness, seed=1)]
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        mean = sum(gaps) / len(gaps)
        return mean, (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean

    (mean_poisson, cv_poisson), (_, cv_bursty), (_, cv_regular) = spread(1.0), spread(0.25), spread(4.0)
    assert mean_poisson == pytest.approx(0.1, rel=0.1)
    assert cv_bursty > cv_poisson > cv_regular


def test_the_sweep_covers_serving_steps_within_the_limits():
    batches = sweep_batches(max_batch_size=64, max_step_tokens=4096, split_fuse_token_num=256, max_context=2048)
    kinds = set()
    for entries in batches:
        assert sum(e["request_num"] for e in entries) <= 64
        assert sum(e["forwarding_token_num"] * e["request_num"] for e in entries) <= 4096
        assert all(e["forwarding_token_num"] <= e["sequence_len"] <= 2048 for e in entries)
        prefill = any(e["forwarding_token_num"] > 1 for e in entries)
        decode = any(e["forwarding_token_num"] == 1 for e in entries)
        cached = any(e["sequence_len"] > e["forwarding_token_num"] > 1 for e in entries)
        kinds.add(("mixed" if prefill and decode else "prefill" if prefill else "decode", cached))
    assert kinds >= {("prefill", False), ("prefill", True), ("decode", False), ("mixed", True)}
    decode_rows = {e["request_num"] for entries in batches for e in entries if e["forwarding_token_num"] == 1}
    assert {1, 64} <= decode_rows


def _ksana(*args, cwd):
    return subprocess.run([sys.executable, "-m", "ksana.cli", "--log-level", "WARNING", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def demo_fit(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli")
    return linear_fit(demo_identity(folder), decode_row_ms=0.1).save(folder / "fit.json")


def test_simulate_writes_the_load_generators_schema(tmp_path, demo_fit):
    write_trace(tmp_path / "trace.jsonl", synthetic_trace(40, 20.0, (8, 64), (4, 16), seed=2))
    done = _ksana("simulate", "--model", "demo", "--profile", str(demo_fit), "--trace", "trace.jsonl",
                  "--goodput", "ttft:50", "--out", "report.json", "--no-progress", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Serving Benchmark Result" in done.stdout
    report = orjson.loads((tmp_path / "report.json").read_bytes())
    for key in ("completed", "duration", "output_throughput", "median_ttft_ms", "p99_tpot_ms", "mean_itl_ms",
                "median_e2el_ms", "request_goodput", "mean_queueing_ms", "total_preemptions", "requests"):
        assert key in report, key
    assert report["completed"] == 40 and report["failed"] == 0
    assert report["total_output_tokens"] == sum(r.output_len for r in read_trace(tmp_path / "trace.jsonl"))
    assert report["simulation"]["num_steps"] > 0


@pytest.mark.parametrize("args, message", [
    (["--goodput", "latency:5"], "unknown SLO metric 'latency'"),
    (["--trace", "missing.jsonl"], "missing.jsonl: cannot read"),
    (["--profile", "nonsense.json"], "nonsense.json: cannot read"),
    (["--model", "smollm2"], "profiled for another configuration"),
])
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, demo_fit, args, message):
    base = ["simulate", "--model", "demo", "--profile", str(demo_fit), "--num-requests", "2", "--no-progress"]
    if "--profile" in args:
        base = ["simulate", "--model", "demo", "--num-requests", "2", "--no-progress"]
    if args[:2] == ["--model", "smollm2"]:
        base = ["simulate", "--profile", str(demo_fit), "--num-requests", "2", "--no-progress"]
    done = _ksana(*base, *args, cwd=tmp_path)
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr


def test_fit_sweep_and_trace_commands(tmp_path):
    assert _ksana("simulate", "sweep", "--max-batch-size", "8", "--out", "b.json", cwd=tmp_path).returncode == 0
    assert len(orjson.loads((tmp_path / "b.json").read_bytes())) > 10
    done = _ksana("simulate", "trace", "--rate", "2", "--num-requests", "5", "--out", "t.jsonl", cwd=tmp_path)
    assert done.returncode == 0 and len(read_trace(tmp_path / "t.jsonl")) == 5
    done = _ksana("simulate", "fit", "absent.json", cwd=tmp_path)
    assert done.returncode == 2 and "absent.json: cannot read" in done.stderr
