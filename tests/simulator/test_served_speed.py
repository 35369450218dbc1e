"""A served run's speed over time (``ksana.simulator.served_speed``) and the simulation that scales its prices by it."""

from __future__ import annotations

import pytest

from ksana.bench.trace import TraceRequest
from ksana.scheduler.step_log import LoggedStep
from ksana.simulator.features import FEATURES, StepShape
from ksana.simulator.latency_model import LinearModel
from ksana.simulator.served_speed import ServedSpeed, SpeedCurve, served_speed
from ksana.simulator.simulate import prepare, run_simulation
from tests.simulator.fits import demo_identity, linear_fit

START = 100.0  # the trace's start on the step log's clock


def _step(started_at: float, duration_s: float, rows: tuple[tuple[int, int], ...]) -> LoggedStep:
    at = START + started_at
    return LoggedStep(step_id=0, rows=rows, planned_at=at, started_at=at, finished_at=at + duration_s,
                      result_at=at + duration_s, prepare_s=0.0, forward_s=duration_s, sample_s=0.0)


def test_a_slow_stretch_shows_in_its_kinds_curve_only():
    """A fit of 10 ms a step and 0.1 ms a prefill token (a 100-token prefill: 20 ms). Decode steps every second run
    at their price throughout; prefills run at price for the first 30 s, then twice it: the prefill curve goes
    from 1.0 to 2.0 past the window's half-width, the decode curve stays at 1.0."""
    fit = linear_fit({})
    decodes = [_step(float(t), 0.010, ((1, 50),)) for t in range(60)]
    prefills = [_step(t + 0.5, 0.020 if t < 30 else 0.040, ((100, 100),)) for t in range(0, 60, 2)]
    speed = served_speed(fit, decodes + prefills, START)
    prefill, decode = speed.prefill, speed.decode
    assert prefill.at(10.0) == pytest.approx(1.0) and prefill.at(50.0) == pytest.approx(2.0)
    assert 1.0 < prefill.at(30.0) < 2.0  # the window straddles the change
    assert set(round(f, 9) for f in decode.factors) == {1.0}
    assert speed.factor(StepShape(((100, 100), (1, 20))), 50.0) == pytest.approx(2.0)
    assert speed.factor(StepShape(((1, 20), (1, 30))), 50.0) == pytest.approx(1.0)
    assert speed.to_json()["decode"]["times_s"][0] == 0.0


def test_a_run_without_prefills_keeps_their_price():
    speed = served_speed(linear_fit({}), [_step(0.0, 0.03, ((1, 50),))], START)
    assert speed.prefill is None and speed.decode.at(0.0) == pytest.approx(3.0)
    assert speed.factor(StepShape(((64, 64),)), 0.0) == 1.0


def test_a_curve_needs_a_factor_per_time():
    with pytest.raises(ValueError, match="one factor per time"):
        SpeedCurve((0.0, 1.0), (1.0,))


def test_the_simulated_worker_scales_each_step_by_the_speed_at_its_start(tmp_path):
    """Served at 1.0 until 0.1 s and at 2.0 after: a lone request's prefill (100 tokens: 20 ms) runs at price, its
    decodes from 0.1 s at twice theirs (10 ms -> 20 ms); prefill and decode curves apart (3.0 for prefills after
    0.1 s, never used)."""
    linear_fit(demo_identity(tmp_path), serving_worker=LinearModel(FEATURES, (10.0, 0.1, 0, 0, 0, 0, 0))).save(
        tmp_path / "fit.json")
    setup = prepare("demo", None, {"dtype": "float32"}, tmp_path / "fit.json")
    speed = ServedSpeed(prefill=SpeedCurve((0.0, 0.1), (1.0, 3.0)), decode=SpeedCurve((0.0, 0.1), (1.0, 2.0)))
    result = run_simulation(setup, [TraceRequest(0.0, 100, 12)], progress=False, speed=speed)
    durations = [round((s.finished_at - s.started_at) * 1000, 6) for s in result.steps]
    starts = [s.started_at - result.steps[0].started_at for s in result.steps]
    assert durations[0] == 20.0
    assert all(d == (20.0 if t >= 0.1 else 10.0) for d, t in zip(durations[1:], starts[1:], strict=True))
    assert 20.0 in durations[1:] and 10.0 in durations[1:]
