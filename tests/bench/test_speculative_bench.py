"""``bench/speculative.py --quick`` on the demo model: both workloads and batch sizes, on and off, one JSON."""

from __future__ import annotations

from pathlib import Path

import orjson

from tests.bench import load_bench


def test_quick_run_compares_on_and_off_for_each_workload_and_batch(tmp_path: Path):
    bench, tables = load_bench("speculative"), load_bench("tables")
    out = tmp_path / "speculative_quick.json"
    assert bench.main(["--quick", "--drafts", "3", "--batches", "1,16", "--out", str(out)]) == 0
    report = orjson.loads(out.read_bytes())
    assert set(report["runs"]) == {"bench", "repetitive"}
    for by_batch in report["runs"].values():
        assert set(by_batch) == {"1", "16"}
        for pair in by_batch.values():
            on, off = pair["on"], pair["off"]
            assert on["output_tokens"] == off["output_tokens"] > 0
            assert off["spec_draft_token_num"] == 0 and off["tokens_per_step"] <= report["runs"]["bench"]["16"][
                "off"]["output_tokens"]
            assert pair["speedup"] == round(on["output_tok_s"] / off["output_tok_s"], 3)
            assert len(on["acceptance_by_position"]) <= 3
    assert report["runs"]["repetitive"]["1"]["on"]["spec_draft_token_num"] > 0
    rows = list(tables.speculative_rows(report))
    assert len(rows) == 4 and all("x**" in result for _, result, _, _ in rows)
