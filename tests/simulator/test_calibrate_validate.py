"""Calibration and validation against a real ``ksana serve`` of the demo model, on small probes and traces: the
served steps' log prices the steps, and ``validate`` separates the step prices from the scheduling."""

from __future__ import annotations

import statistics

import pytest

from ksana.bench.trace import read_trace, synthetic_trace, write_trace
from ksana.scheduler.step_log import read_step_log
from ksana.simulator.calibrate import calibrate
from ksana.simulator.features import StepShape
from ksana.simulator.fit import load_fit
from ksana.simulator.validate import METRICS, validate
from tests.simulator.fits import demo_identity, linear_fit

SMALL_PROBE = (
    {"num": 3, "rate": 20.0, "input_len": (8, 32), "output_len": (4, 8), "burstiness": 1.0, "seed": 1},
    {"num": 8, "rate": 50.0, "input_len": (16, 64), "output_len": (8, 16), "burstiness": 1.0, "seed": 2},
)


@pytest.fixture(scope="module")
def slow_fit(tmp_path_factory):
    """A fit for the demo model that prices every step at 10 ms, far above what the demo's steps cost."""
    folder = tmp_path_factory.mktemp("fit")
    return linear_fit(demo_identity(folder)).save(folder / "fit.json")


def test_calibration_prices_steps_from_the_probes_step_log(tmp_path, slow_fit):
    fit, measured = calibrate("demo", slow_fit, None, {"dtype": "float32"}, tmp_path, phases=SMALL_PROBE)
    assert [phase["completed"] for phase in measured] == [p["num"] for p in SMALL_PROBE]
    logged = read_step_log(fit.calibration["probe"]["step_log"])
    steps = logged[-fit.calibration["probe"]["num_steps"]:]  # after the warm-up's
    assert 0 < len(steps) < len(logged)
    # every probe request is followed from its arrival through each of its tokens' steps to its client's reads
    by_phase = fit.calibration["phases"]
    assert [p["num_requests"] for p in by_phase] == [p["num"] for p in SMALL_PROBE]
    assert fit.serving_admission_ms >= 0.0 and all(p["admission_ms"] is not None for p in by_phase)
    assert all(c >= 0 for c in fit.serving_delivery.coef) and all(p["delivery_ms"] is not None for p in by_phase)
    assert all(c >= 0 for c in fit.serving_worker.model.coef)
    # The slow fit's 10 ms a step is gone: the steps are priced as they ran (the fit minimises relative error, so
    # the median step is where it matches; the demo's few slow steps, a collection or a first call, are not).
    ratios = [step.duration_s / fit.worker_s(StepShape(step.rows)) for step in steps]
    assert statistics.median(ratios) == pytest.approx(1.0, abs=0.25)


def test_validation_reports_the_step_prices_and_the_run_with_its_own_costs_and_speed(tmp_path, slow_fit):
    trace = write_trace(tmp_path / "trace.jsonl", synthetic_trace(8, 30.0, (8, 48), (4, 12), seed=5))
    report = validate("demo", trace, slow_fit, None, {"dtype": "float32"}, tmp_path / "validation.json",
                      progress=False, calibrate_first=False)
    ratio = report["step_cost_ratio"]
    assert ratio["num_steps"] == len(read_step_log(tmp_path / "validation" / "measured_steps.jsonl")) > 0
    assert ratio["all"] < 1.0  # the demo's steps take well under the fit's 10 ms
    assert set(report["metrics_with_served_steps"]) == {name for name, _ in METRICS}
    outside = report["outside_engine_ms"]
    assert outside["fit"] == {"admission": 0.0, "delivery": {"const": 0.0, "per_row": 0.0}}
    assert outside["served"]["admission"] >= 0.0 and min(outside["served"]["delivery"].values()) >= 0.0
    with_fit, with_served = report["metrics"]["e2el_p50_ms"], report["metrics_with_served_steps"]["e2el_p50_ms"]
    assert with_served["rel_error"] < with_fit["rel_error"]
    # the fit's prices at the run's own speed: the demo's steps ran at a fraction of the slow fit's 10 ms
    assert 0.0 < max(report["served_speed"]["decode"]["factors"]) < 1.0
    at_speed = report["metrics_with_served_speed"]["e2el_p50_ms"]
    assert at_speed["rel_error"] < with_fit["rel_error"]


def test_validation_calibrates_on_the_server_it_measures(tmp_path, slow_fit):
    """An uncalibrated fit: a warm-up, the probe, then the trace, on one server; the probe's steps price the
    simulation and the trace's alone are compared with the prices."""
    trace = write_trace(tmp_path / "trace.jsonl", synthetic_trace(6, 30.0, (8, 48), (4, 12), seed=6))
    report = validate("demo", trace, slow_fit, None, {"dtype": "float32"}, tmp_path / "validation.json",
                      progress=False, probe_phases=SMALL_PROBE)
    logged = read_step_log(tmp_path / "validation" / "measured_steps.jsonl")
    fit = load_fit(report["profile"])
    assert fit.calibration is not None and fit.serving_worker is not None
    probe_steps, trace_steps = fit.calibration["probe"]["num_steps"], report["step_cost_ratio"]["num_steps"]
    # a warm-up's steps, the probe's, then the trace's: the last ones, which hold exactly the trace's prompts
    assert probe_steps > 0 and trace_steps > 0 and probe_steps + trace_steps < len(logged)
    prompts = sorted(r.prompt_len for r in read_trace(trace))
    assert sorted(c for step in logged[-trace_steps:] for q, c in step.rows if q == c and q > 1) == prompts
    assert report["serving_admission_ms"] == fit.serving_admission_ms >= 0.0
    assert report["serving_delivery_ms"] == fit.serving_delivery.to_json()
