"""``bench/simulator_validation.py``'s summary of repeated validations."""

from __future__ import annotations

import pytest

from tests.bench import load_bench


def _table(measured: float, simulated: float) -> dict[str, dict[str, float]]:
    return {"ttft_p50_ms": {"measured": measured, "simulated": simulated,
                            "rel_error": abs(simulated - measured) / measured}}


def test_repeated_runs_compare_the_medians_of_each_side() -> None:
    bench = load_bench("simulator_validation")
    # run by run 25%, 7.7% and 25% off; the medians of each side, 100 measured and 120 simulated: 20%
    runs = [_table(100.0, 125.0), _table(130.0, 120.0), _table(80.0, 100.0)]
    row = bench.median_metrics(runs)["ttft_p50_ms"]
    assert row["measured"] == 100.0 and row["simulated"] == 120.0
    assert row["rel_error"] == pytest.approx(0.2)
    assert bench.median_metrics([_table(50.0, 40.0)]) == _table(50.0, 40.0)


def test_the_measured_spread_is_the_furthest_run_from_the_median() -> None:
    bench = load_bench("simulator_validation")
    runs = [_table(100.0, 125.0), _table(130.0, 120.0), _table(80.0, 100.0)]  # median 100: 30% up, 20% down
    assert bench.measured_spread(runs)["ttft_p50_ms"] == pytest.approx(0.3)
    assert bench.measured_spread([_table(50.0, 40.0)]) == {"ttft_p50_ms": 0.0}


def test_the_runs_time_outside_the_engine_is_each_figures_median() -> None:
    bench = load_bench("simulator_validation")
    runs = [{"admission": a, "delivery": {"const": c, "per_row": r}}
            for a, c, r in ((7.0, 4.0, 1.5), (9.0, 2.0, 0.5), (6.0, 5.0, 1.0))]
    assert bench.median_outside([*runs, None]) == {"admission": 7.0, "delivery": {"const": 4.0, "per_row": 1.0}}
    assert bench.median_outside([None, None]) is None
