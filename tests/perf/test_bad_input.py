"""Bad perf input: one line naming the file and the key or batch, exit code 2, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ksana.cli import main
from ksana.perf import runner as perf_runner

GOOD_BATCH = {"forwarding_token_num": 8, "sequence_len": 40, "request_num": 2}


def _write(folder, perf_config=None, batches=None, raw_perf=None, raw_batches=None, runtime=None):
    config = {"model_dir": "demo", "batch_config": "batches.json", "warmup_rounds": 0, "stat_rounds": 1,
              "output_file": "result.json"}
    config.update(perf_config or {})
    if runtime is not None:
        (folder / "runtime.yaml").write_text(runtime)
        config["runtime_config"] = "runtime.yaml"
    (folder / "model_perf_config.json").write_text(raw_perf if raw_perf is not None else json.dumps(config))
    body = raw_batches if raw_batches is not None else json.dumps(batches or {"batch_0": {"dp_0": [GOOD_BATCH]}})
    (folder / "batches.json").write_text(body)
    return folder / "model_perf_config.json"


def _perf(capsys, config, *flags: str) -> tuple[int, str]:
    code = main(["perf", "--config", str(config), "--no-progress", *flags])
    return code, capsys.readouterr().err


CASES = {
    "malformed perf config": (dict(raw_perf='{"model_dir": "demo",'), (), ["model_perf_config.json", "not valid JSON"]),
    "missing perf key": (dict(raw_perf='{"model_dir": "demo"}'), (), ["model_perf_config.json",
                                                                      "missing key 'batch_config'"]),
    "perf config not an object": (dict(raw_perf="[1, 2]"), (), ["model_perf_config.json", "must be a JSON object"]),
    "unknown perf key": (dict(perf_config={"warmup_round": 2}), (), ["model_perf_config.json", "unknown key 'warmup_round'"]),
    "wrong perf type": (dict(perf_config={"stat_rounds": "5"}), (), ["model_perf_config.json", "'stat_rounds'", 'string "5"']),
    "bool is not a count": (dict(perf_config={"warmup_rounds": True}), (), ["'warmup_rounds'", "integer >= 0"]),
    "layer_forward_round out of range": (dict(perf_config={"layer_forward_round": 100}), (), ["'layer_forward_round'"]),
    "missing batch config": (dict(perf_config={"batch_config": "nowhere.json"}), (), ["nowhere.json", "not found"]),
    "malformed batch config": (dict(raw_batches='{"batch_0": {"dp_0": [}'), (), ["batches.json", "not valid JSON"]),
    "unknown top-level key": (dict(batches={"batch_0": {"dp_0": [GOOD_BATCH]}, "batchx": {}}), (),
                              ["batches.json", "unknown key 'batchx'"]),
    "unknown request key": (dict(batches={"batch_3": {"dp_0": [{"forwarding_token_num": 1, "seq_len": 9}]}}), (),
                            ["batches.json", "batch_3.dp_0[0]", "unknown key 'seq_len'"]),
    "wrong request type": (dict(batches={"batch_1": {"dp_0": [{"forwarding_token_num": 1, "sequence_len": 2.5}]}}), (),
                           ["batches.json", "batch_1.dp_0[0].sequence_len", "integer >= 1"]),
    "forwarding beyond sequence": (dict(batches={"batch_0": {"dp_0": [{"forwarding_token_num": 9, "sequence_len": 4}]}}),
                                   (), ["batch_0.dp_0[0]", "exceeds sequence_len"]),
    "second dp group": (dict(batches={"batch_2": {"dp_0": [GOOD_BATCH], "dp_1": [GOOD_BATCH]}}), (),
                        ["batches.json", "batch_2.dp_1", "only dp_0"]),
    "no batches": (dict(batches={"layer_forward_round": 2}), (), ["batches.json", "no batches"]),
    "over max_batch_size": (dict(batches={"batch_0": {"dp_0": [GOOD_BATCH]},
                                          "batch_1": {"dp_0": [{"forwarding_token_num": 1, "sequence_len": 9,
                                                                "request_num": 5}]}}),
                            ("--max-batch-size", "4"), ["batches.json", "batch_1", "max_batch_size=4"]),
    "over max_step_tokens": (dict(batches={"batch_0": {"dp_0": [GOOD_BATCH, {"forwarding_token_num": 60,
                                                                             "sequence_len": 60}]}}),
                             ("--max-step-tokens", "64"), ["batches.json", "batch_0 forwards 76 tokens",
                                                           "max_step_tokens=64"]),
    "chunked by split_fuse": (dict(runtime="setting:\n  batch_scheduler:\n    split_fuse_token_num: 4\n"), (),
                              ["batches.json", "batch_0.dp_0[0]", "split_fuse_token_num=4"]),
    "over the KV pool": (dict(batches={"batch_5": {"dp_0": [{"forwarding_token_num": 1, "sequence_len": 100,
                                                             "request_num": 3}]}}),
                         ("--num-device-blocks", "12"), ["batches.json", "batch_5 needs 21 KV blocks", "has 12",
                                                         "num_device_blocks"]),
    "beyond the model's length": (dict(batches={"batch_0": {"dp_0": [{"forwarding_token_num": 1,
                                                                      "sequence_len": 2048}]}}), (),
                                  ["batches.json", "batch_0.dp_0[0]", "max_token_len=2048"]),
    "unknown runtime key": (dict(runtime="setting:\n  batch_scheduler:\n    max_batch_sise: 4\n"), (),
                            ["setting.batch_scheduler.max_batch_sise"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_clear_line(tmp_path, capsys, case):
    files, flags, expected = CASES[case]
    code, err = _perf(capsys, _write(tmp_path, **files), *flags)
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("ksana perf: error:")]
    assert len(lines) == 1, err
    for fragment in expected:
        assert fragment in lines[0]
    assert not (tmp_path / "result.json").exists()


def test_missing_config_file_as_a_real_process(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ksana.cli", "perf", "--config", str(tmp_path / "absent.json")],
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2
    assert f"{tmp_path / 'absent.json'}: model perf config not found" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_batch_the_scheduler_splits_is_caught_after_the_round(tmp_path, capsys, monkeypatch):
    """The checks before the run are backed by one after each round: a batch split over two steps is an error."""
    monkeypatch.setattr(perf_runner, "check_batches_fit", lambda *args: None)
    # Three requests of 4 blocks each in a 10-block pool: the scheduler runs two, then the third.
    config = _write(tmp_path, batches={"batch_7": {"dp_0": [{"forwarding_token_num": 1, "sequence_len": 64,
                                                             "request_num": 3}]}})
    code, err = _perf(capsys, config, "--num-device-blocks", "10", "--block-token-num", "16")
    assert code == 2, err
    assert "batch_7 (3 requests, 3 tokens) did not run as one step" in err
    assert "2 requests/2 tokens, 1 requests/1 tokens" in err


def test_a_kv_pool_larger_than_memory_names_the_batch(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(perf_runner, "available_memory_bytes", lambda device: 100 * 1024)
    config = _write(tmp_path, batches={"batch_0": {"dp_0": [GOOD_BATCH]},
                                       "batch_1": {"dp_0": [{"forwarding_token_num": 1, "sequence_len": 100,
                                                             "request_num": 3}]}})
    code, err = _perf(capsys, config, "--device", "cpu")
    assert code == 2, err
    assert "batches.json: batch_1 needs 21 KV blocks" in err and "MiB of cpu memory available" in err
