"""``ksana perf`` end to end on the demo model: one real process, then its result file is checked from every side."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from ksana.perf.csv_writer import CSV_HEADER
from ksana.perf.operator_profiler import OPERATORS

SCHEMA = Path(__file__).resolve().parents[2] / "perf" / "schema" / "perf_result.schema.json"
WARMUP_ROUNDS, STAT_ROUNDS, LAYER_FORWARD_ROUND = 1, 5, 2
BATCHES = {
    "batch_0": {"dp_0": [{"forwarding_token_num": 1, "sequence_len": 1024, "request_num": 1}]},
    "batch_1": {"dp_0": [{"forwarding_token_num": 1, "sequence_len": 1024, "request_num": 32}]},
    "batch_2": {"dp_0": [{"forwarding_token_num": 64, "sequence_len": 64}]},
    "batch_3": {"dp_0": [{"forwarding_token_num": 1024, "sequence_len": 1024}]},
    "batch_4": {"dp_0": [  # mixed: a chunk over a cached prefix, a fresh prefill and decodes
        {"forwarding_token_num": 48, "sequence_len": 112},
        {"forwarding_token_num": 20, "sequence_len": 20, "request_num": 2},
        {"forwarding_token_num": 1, "sequence_len": 300, "request_num": 3},
    ]},
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("perf")
    (folder / "batches.json").write_text(json.dumps(BATCHES))
    config = {"model_dir": "demo", "batch_config": "batches.json", "warmup_rounds": WARMUP_ROUNDS,
              "stat_rounds": STAT_ROUNDS, "output_file": "result.json", "layer_forward_round": LAYER_FORWARD_ROUND}
    (folder / "model_perf_config.json").write_text(json.dumps(config))
    proc = subprocess.run(
        [sys.executable, "-m", "ksana.cli", "perf", "--config", str(folder / "model_perf_config.json"),
         "--output-csv", str(folder / "result.csv"), "--device", "cpu", "--num-threads", "1"],
        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
    )
    result = json.loads((folder / "result.json").read_text()) if proc.returncode == 0 else None
    return proc, result, folder


@pytest.fixture(scope="module")
def batches(run):
    proc, result, _ = run
    assert proc.returncode == 0, proc.stderr
    return {b["name"]: b for b in result["batches"]}


def test_process_exits_zero_and_result_matches_the_schema(run):
    proc, result, folder = run
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    jsonschema.validate(result, json.loads(SCHEMA.read_text()), cls=jsonschema.Draft202012Validator)
    assert "batch_4 stat" in proc.stderr, "progress bar on stderr"
    assert str(folder / "result.json") in proc.stdout


def test_every_batch_and_round_is_there_as_configured(run, batches):
    _, result, folder = run
    assert list(batches) == list(BATCHES)
    meta = result["meta"]
    assert (meta["warmup_rounds"], meta["stat_rounds"], meta["layer_forward_round"]) == (
        WARMUP_ROUNDS, STAT_ROUNDS, LAYER_FORWARD_ROUND)
    assert meta["inputs"]["batch_config"]["content"] == BATCHES
    assert meta["inputs"]["model_perf_config"]["content"]["stat_rounds"] == STAT_ROUNDS
    assert meta["model"]["num_layers"] == 2 and meta["model"]["vocab_size"] == 1024
    assert meta["device"]["type"] == "cpu" and meta["device"]["num_threads"] == 1
    for name, batch in batches.items():
        assert batch["num_warmup_rounds"] == WARMUP_ROUNDS
        assert [r["round"] for r in batch["rounds"]] == list(range(STAT_ROUNDS))
        specs = BATCHES[name]["dp_0"]
        num_requests = sum(s.get("request_num", 1) for s in specs)
        num_tokens = sum(s["forwarding_token_num"] * s.get("request_num", 1) for s in specs)
        assert batch["num_requests"] == num_requests and batch["num_tokens"] == num_tokens
        for r in batch["rounds"]:  # each round was one engine step holding the whole batch
            assert (r["num_scheduled_requests"], r["num_scheduled_tokens"]) == (num_requests, num_tokens)
            # The timers nest: the forward inside the worker's call inside the step, allocation inside scheduling.
            assert r["forward_ms"] <= r["worker_ms"] <= r["step_ms"]
            assert r["block_allocation_ms"] <= r["schedule_ms"]
    assert (batches["batch_4"]["num_prefill_requests"], batches["batch_4"]["num_decode_requests"]) == (3, 3)


def test_operator_calls_follow_the_model_and_layer_forward_round(batches):
    num_layers, repeats = 2, LAYER_FORWARD_ROUND
    for batch in batches.values():
        ops = batch["rounds"][0]["operators"]
        assert set(ops) == set(OPERATORS)
        for name in ("qkv_proj", "o_proj", "mlp_gate_up", "mlp_act", "mlp_down", "kv_cache_store"):
            assert ops[name]["calls"] == num_layers * repeats, name
            assert len(ops[name]["per_layer_ms"]) == num_layers and min(ops[name]["per_layer_ms"]) > 0
        assert ops["norm"]["calls"] == 2 * num_layers * repeats + 1  # two per layer, then the final norm
        assert ops["embedding"]["calls"] == ops["lm_head"]["calls"] == ops["sampler"]["calls"] == 1
        assert ops["all_reduce"]["calls"] == 0
        num_prefills = batch["num_prefill_requests"]
        assert ops["attention_prefill"]["calls"] == num_prefills * num_layers * repeats
        assert ops["attention_decode"]["calls"] == (num_layers * repeats if batch["num_decode_requests"] else 0)
        assert batch["operators"]["qkv_proj"]["calls"] == num_layers * repeats


def test_operator_times_nest_inside_the_forward(batches):
    """Each round's operators ran one after another inside the runner's forward: their sum fits in the span from
    the first one's start to the last one's end, and that span in the forward (to its rounding)."""
    for batch in batches.values():
        for r in batch["rounds"]:
            assert r["operator_sum_ms"] <= r["operator_span_ms"] <= r["forward_ms"] * 1.001, (batch["name"], r)


def test_ksanallm_csv(run):
    _, _, folder = run
    lines = (folder / "result.csv").read_text().splitlines()
    assert lines[0] == CSV_HEADER
    assert len(CSV_HEADER.split(",")) == 11
    assert len(lines) == 1 + len(BATCHES)
    number = r"\d+\.\d{3}"
    row = re.compile(rf"{STAT_ROUNDS},{LAYER_FORWARD_ROUND},\d+,\d+,\d+,{number},{number}, \d+,{number},{number},{number}")
    assert all(row.fullmatch(line) for line in lines[1:]), lines
    assert lines[5].startswith(f"{STAT_ROUNDS},{LAYER_FORWARD_ROUND},6,1052,3,50.667,29.333, 3,300.000,1.000,")
