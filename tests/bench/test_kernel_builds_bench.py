"""``bench/kernel_builds.py`` on its quickest setting: this tree against itself, one round of one workload."""

from __future__ import annotations

import pytest

from tests.bench import REPO, load_bench


def test_a_tree_against_itself_gives_one_ratio_per_workload() -> None:
    if not (REPO / ".venv" / "bin" / "python").exists():
        pytest.skip("the script runs each tree's own .venv")
    bench = load_bench("kernel_builds")
    report = bench.run_bench(REPO, REPO, "float32", rounds=1, workloads=("decode_b1",), quick=True)
    row = report["workloads"]["decode_b1"]
    assert row["unit"] == "ms/step"
    assert row["baseline_median"] > 0 and row["candidate_median"] > 0
    assert row["candidate_over_baseline"] == pytest.approx(row["candidate_median"] / row["baseline_median"])
    assert report["baseline"]["revision"] == report["candidate"]["revision"]
    assert "decode_b1" in bench.format_report(report)
