"""``bench/serving_vs_offline.py`` on the demo model: both runs complete the same workload; no timing thresholds."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from tests.bench import load_bench


def test_quick_run_reports_interleaved_rounds_over_the_same_tokens(tmp_path: Path):
    bench = load_bench("serving_vs_offline")
    out = tmp_path / "serving_vs_offline.json"
    assert bench.main(["--quick", "--num-prompts", "5", "--rounds", "2", "--out", str(out), "--stream-interval", "2",
                       "--max-batch-size", "4"]) == 0
    report = orjson.loads(out.read_bytes())
    assert report["model"] == "demo" and report["num_prompts"] == 5
    assert report["engine_flags"] == ["--max-batch-size", "4"] and report["stream_interval"] == 2
    rounds = report["rounds"]
    assert [r["order"] for r in rounds] == [["offline", "online"], ["online", "offline"]]
    for r in rounds:
        offline, online = r["offline"], r["online"]
        assert offline["output_tokens"] == online["output_tokens"] == report["requested_output_tokens"] > 0
        assert online["completed"] == 5 and online["failed"] == 0 and online["errors"] == []
        assert r["ratio"] == online["output_tok_s"] / offline["output_tok_s"]
        assert offline["server_cpu_s"] >= 0
        assert online["client_cpu_us_per_token"] > 0 and online["loop_cpu_us_per_token"] >= 0
    for side in ("offline", "online"):
        pooled = report[side]
        assert pooled["runs"] == 2 and pooled["output_tokens"] == 2 * report["requested_output_tokens"]
        assert pooled["seconds"] == sum(r[side]["seconds"] for r in rounds)
    for key in ("loop_cpu_us_per_token", "client_cpu_us_per_token"):  # token-weighted over the rounds
        assert report["online"][key] == pytest.approx(sum(r["online"][key] for r in rounds) / 2)
    assert report["ratio"] == report["online"]["output_tok_s"] / report["offline"]["output_tok_s"]
    assert min(r["ratio"] for r in rounds) <= report["ratio_median"] <= max(r["ratio"] for r in rounds)


def test_rounds_must_be_positive(capsys):
    bench = load_bench("serving_vs_offline")
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--rounds", "0"])
    assert "--rounds: must be at least 1, got 0" in capsys.readouterr().err
