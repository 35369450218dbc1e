"""``bench/serving_vs_offline.py`` on the demo model: both runs complete the same workload; no timing thresholds."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parents[2]


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_serving_vs_offline_under_test",
                                                  REPO / "bench" / "serving_vs_offline.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_quick_run_reports_both_throughputs_over_the_same_tokens(tmp_path: Path):
    bench = load_bench()
    out = tmp_path / "serving_vs_offline.json"
    assert bench.main(["--quick", "--num-prompts", "5", "--out", str(out), "--max-batch-size", "4"]) == 0
    report = orjson.loads(out.read_bytes())
    assert report["model"] == "demo" and report["num_prompts"] == 5
    assert report["engine_flags"] == ["--max-batch-size", "4"]
    offline, online = report["offline"], report["online"]
    assert offline["output_tokens"] == online["output_tokens"] == report["requested_output_tokens"] > 0
    assert online["completed"] == 5 and online["failed"] == 0 and online["errors"] == []
    assert offline["output_tok_s"] > 0 and online["output_tok_s"] > 0
    assert report["ratio"] == online["output_tok_s"] / offline["output_tok_s"]
