"""``ksana perf`` with ``setting.global.tensor_para_size: 2`` in its runtime YAML: the result gains the all-reduce
operator (two per layer pass, plus the vocabulary-parallel embedding and lm_head gather)."""

from __future__ import annotations

import json
import subprocess
import sys

LAYER_FORWARD_ROUND = 2
NUM_LAYERS = 2  # the demo model


def test_perf_run_with_tp2_times_the_all_reduce(tmp_path):
    batches = {"batch_0": {"dp_0": [{"forwarding_token_num": 16, "sequence_len": 16},
                                    {"forwarding_token_num": 1, "sequence_len": 40, "request_num": 2}]}}
    (tmp_path / "batches.json").write_text(json.dumps(batches))
    (tmp_path / "runtime.yaml").write_text("setting:\n  global:\n    tensor_para_size: 2\n")
    config = {"model_dir": "demo", "batch_config": "batches.json", "runtime_config": "runtime.yaml",
              "warmup_rounds": 1, "stat_rounds": 2, "output_file": "result.json",
              "layer_forward_round": LAYER_FORWARD_ROUND}
    (tmp_path / "model_perf_config.json").write_text(json.dumps(config))
    proc = subprocess.run(
        [sys.executable, "-m", "ksana.cli", "perf", "--config", str(tmp_path / "model_perf_config.json"),
         "--no-progress", "--device", "cpu"], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["meta"]["runtime"]["tensor_para_size"] == 2
    for round_ in result["batches"][0]["rounds"]:
        ops = round_["operators"]
        assert ops["all_reduce"]["calls"] == 2 * NUM_LAYERS * LAYER_FORWARD_ROUND + 2
        assert min(ops["all_reduce"]["per_layer_ms"]) > 0
        assert ops["o_proj"]["calls"] == ops["mlp_down"]["calls"] == NUM_LAYERS * LAYER_FORWARD_ROUND
