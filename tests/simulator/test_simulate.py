"""The simulator drives the engine's own scheduler and cache manager on a virtual clock: times follow the fit
exactly, async scheduling hides the engine's time, a small KV pool preempts, and every request gets its tokens."""

from __future__ import annotations

import json
import math

import pytest

from ksana.bench.trace import TraceError, TraceRequest
from ksana.simulator.features import FEATURES
from ksana.simulator.fit import check_identity
from ksana.simulator.latency_model import LinearModel
from ksana.simulator.profile import ProfileError
from ksana.simulator.report import build_report
from ksana.simulator.simulate import prepare, run_simulation
from tests.simulator.fits import linear_fit


@pytest.fixture(scope="module")
def identity(tmp_path_factory):
    """The demo model's identity, as a profile of it would carry."""
    fit_path = tmp_path_factory.mktemp("fit") / "fit.json"
    linear_fit({}).save(fit_path)
    setup = prepare("demo", None, {}, fit_path)
    shape = setup.shape
    return {"model_type": shape.model_type, "hidden_size": shape.hidden_size, "num_layers": shape.num_layers,
            "num_heads": shape.num_heads, "num_kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim,
            "intermediate_size": shape.intermediate_size, "vocab_size": shape.vocab_size, "dtype": "float32",
            "device_type": "cpu"}


def _setup(tmp_path, identity, overrides=None, **fit_kwargs):
    path = tmp_path / "fit.json"
    linear_fit(identity, **fit_kwargs).save(path)
    return prepare("demo", None, {"dtype": "float32", **(overrides or {})}, path)


def _ms(times):
    return [round(t * 1000, 6) for t in times]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_lone_request_follows_the_fit(tmp_path, identity, async_scheduling):
    """Prefill of 100 tokens: 10 + 0.1 * 100 = 20 ms; each decode 10 ms; 5 ms of engine time per step. With no
    request waiting every step waits for the engine, async scheduling or not (the next plan takes any arrival)."""
    setup = _setup(tmp_path, identity, {"async_scheduling": async_scheduling}, engine_ms=5.0)
    result = run_simulation(setup, [TraceRequest(0.0, 100, 3)], progress=False)
    (timeline,) = result.timelines
    assert _ms(timeline.token_times_s) == [25.0, 40.0, 55.0]
    assert [round(s.finished_at - s.started_at, 6) for s in result.steps] == [0.02, 0.01, 0.01]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_async_scheduling_hides_the_engine_time_while_a_request_waits(tmp_path, identity, async_scheduling):
    """One request at a time, the second waiting: with async scheduling the first one's decodes start as the step
    before ends (its plan was made while that step ran), so its tokens come 10 ms apart, not 15."""
    setup = _setup(tmp_path, identity, {"async_scheduling": async_scheduling, "max_batch_size": 1}, engine_ms=5.0)
    result = run_simulation(setup, [TraceRequest(0.0, 100, 3), TraceRequest(0.0, 100, 3)], progress=False)
    first = result.timelines[0]
    assert _ms(first.token_times_s) == ([25.0, 35.0, 45.0] if async_scheduling else [25.0, 40.0, 55.0])
    assert all(len(t.token_times_s) == 3 for t in result.timelines)


def test_a_calibrated_fit_prices_steps_as_served_and_adds_the_admission(tmp_path, identity):
    """The served steps' model (15 ms a step, 0.1 ms a prefill token, 2 ms a row) replaces perf mode's (10 ms a
    step, 0.1 ms a prefill token); the first request reaches the engine 30 ms after its arrival, from which its
    latencies count."""
    served = LinearModel(FEATURES, (15.0, 0.1, 0.0, 0.0, 0.0, 0.0, 2.0))
    setup = _setup(tmp_path, identity, serving_worker=served, serving_admission_ms=30.0)
    assert setup.fit.serving_worker.model == served  # through the saved fit's JSON
    result = run_simulation(setup, [TraceRequest(0.0, 100, 3), TraceRequest(0.0, 100, 3)], progress=False)
    # the first prefill (15 + 10 + 2 ms); the second prefill, which came while it ran, beside its decode
    # (15 + 10 + 2 x 2); both decodes (15 + 2 x 2); the second's last decode (15 + 2)
    assert [round(s.finished_at - s.started_at, 6) for s in result.steps] == [0.027, 0.029, 0.019, 0.017]
    assert _ms(result.timelines[0].token_times_s) == [57.0, 86.0, 105.0]
    assert _ms(result.timelines[1].token_times_s) == [86.0, 105.0, 122.0]


def test_tokens_reach_their_clients_within_their_steps_delivery_window(tmp_path, identity):
    """A token reaches its client ``const + u * 2 * per_row * rows`` ms after its step's result (1 ms and 2 ms a
    row here, four rows a decode step: 1 to 17 ms, 9 on average), in its stream's order; the steps themselves run
    as without a delivery, which happens outside the engine."""
    requests = [TraceRequest(0.0, 100, 40) for _ in range(4)]
    plain = run_simulation(_setup(tmp_path, identity), requests, progress=False)
    delivered = run_simulation(_setup(tmp_path, identity, serving_delivery=LinearModel(("const", "rows"),
                                                                                       (1.0, 2.0))),
                               requests, progress=False)
    assert [(s.started_at, s.finished_at) for s in delivered.steps] == [(s.started_at, s.finished_at)
                                                                         for s in plain.steps]
    late = [(d - p) * 1000 for before, after in zip(plain.timelines, delivered.timelines, strict=True)
            for p, d in zip(before.token_times_s[1:], after.token_times_s[1:], strict=True)]  # the decodes'
    assert all(1.0 - 1e-9 <= ms <= 17.0 + 1e-9 for ms in late)
    assert 8.0 <= sum(late) / len(late) <= 11.0  # a little above 9: a token held behind the one before it
    assert all(t.token_times_s == sorted(t.token_times_s) for t in delivered.timelines)


def test_a_requests_time_outside_the_engine_splits_at_the_engine():
    """The admission runs from a request's due time (the load generator's start plus its arrival) to the
    scheduler's receipt; each token's delivery from the result of the step that computed it to its client's read.
    The step log's request ids follow a request through its prompt's chunks and its decodes."""
    from ksana.scheduler.step_log import LoggedStep
    from ksana.simulator.calibrate import RequestDelay, fit_delivery, median_admission_ms, request_delays

    def step(rows, ids, arrivals, result_at):
        return LoggedStep(0, rows, result_at - 0.05, result_at - 0.05, result_at, result_at, 0.0, 0.0, 0.0,
                          arrivals, ids)

    requests = [TraceRequest(0.0, 100, 3), TraceRequest(1.0, 300, 2)]
    # "a" is due at 10.0 and received at 10.004; "b" at 11.0 and 11.002, its prompt in two chunks beside a row of
    # another request whose context passes 300 (a prefix of "b"'s length, not "b")
    steps = [step(((100, 100),), ("a",), ((0, 10.004),), 10.10),
             step(((1, 101),), ("a",), (), 10.12),
             step(((1, 102),), ("a",), (), 10.14),
             step(((256, 256), (1, 310)), ("b", "c"), ((0, 11.002),), 11.10),
             step(((44, 300), (1, 311)), ("b", "c"), (), 11.30),
             step(((1, 301),), ("b",), (), 11.32)]
    measured = {"start_monotonic_s": 10.0, "requests": [
        {"success": True, "ttft": 0.11, "itl": [0.03, 0.02]},  # read at 10.11, 10.14 and 10.16
        {"success": True, "ttft": 0.31, "itl": [0.05]}]}  # read at 11.31 and 11.36
    delays = request_delays(measured, requests, steps)
    assert delays[0].admission_ms == pytest.approx(4.0) and delays[1].admission_ms == pytest.approx(2.0)
    assert [(rows, round(ms, 6)) for rows, ms in delays[0].deliveries] == [(1, 10.0), (1, 20.0), (1, 20.0)]
    assert [(rows, round(ms, 6)) for rows, ms in delays[1].deliveries] == [(2, 10.0), (1, 40.0)]
    assert median_admission_ms(delays) == pytest.approx(3.0)
    assert median_admission_ms([None]) is None and fit_delivery([None]) is None
    line = [RequestDelay(0.0, tuple((rows, 1.0 + 2.0 * rows) for rows in (1, 2, 4, 10)))]
    assert fit_delivery(line).coef == pytest.approx((1.0, 2.0))
    # A failed request, an arrival whose prompt is not the request's (matched out of order), or a first step that
    # does not start the prompt afresh (a prefix-cache hit): no delays. A prompt whose last chunk never ran: no
    # deliveries.
    failed = {**measured, "requests": [{"success": False, "ttft": 0.0, "itl": []}, measured["requests"][1]]}
    assert request_delays(failed, requests, steps)[0] is None
    swapped = [TraceRequest(0.0, 50, 4), TraceRequest(1.0, 100, 4)]
    assert request_delays(measured, swapped, steps) == [None, None]
    cached = [step(((36, 100),), ("a",), ((0, 10.004),), 10.10), *steps[1:]]
    assert request_delays(measured, requests, cached)[0] is None
    assert request_delays(measured, requests, steps[:4])[1].deliveries == ()


def test_a_fit_keeps_its_admission_and_delivery_and_reads_a_single_request_cost_as_delivery(tmp_path, identity):
    from ksana.simulator.fit import load_fit

    delivery = LinearModel(("const", "rows"), (4.0, 0.5))
    fit = load_fit(linear_fit(identity, serving_admission_ms=3.0, serving_delivery=delivery).save(tmp_path / "f.json"))
    assert (fit.serving_admission_ms, fit.serving_delivery) == (3.0, delivery)
    assert fit.delivery_s(10) == pytest.approx(0.009) and fit.delivery_s(10, 0.0) == pytest.approx(0.004)
    old = {**linear_fit(identity).to_json(), "version": 1, "serving_request_ms": 12.0}
    del old["serving_admission_ms"], old["serving_delivery_ms"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    read = load_fit(tmp_path / "old.json")
    assert read.serving_admission_ms == 0.0 and read.delivery_s(60, 0.9) == pytest.approx(0.012)


def test_the_probe_burst_widens_to_cover_the_trace():
    from ksana.simulator.calibrate import PROBE_PHASES, probe_phases_for

    burst, light = probe_phases_for([TraceRequest(0.0, 1500, 16), TraceRequest(1.0, 700, 300)])
    assert burst["num"] == PROBE_PHASES[0]["num"]  # as many requests as the trace could run at once, at least
    wide, _ = probe_phases_for([TraceRequest(0.0, 100, 70)] * 100, max_batch_size=64)
    assert wide["num"] == 64
    assert PROBE_PHASES[0]["rate"] > PROBE_PHASES[1]["rate"]  # the burst warms the server before the light phase
    assert light == PROBE_PHASES[1]
    assert burst["input_len"] == (PROBE_PHASES[0]["input_len"][0], 1500)
    assert burst["output_len"] == (16, 300)
    assert probe_phases_for([TraceRequest(0.0, 100, 70)]) == PROBE_PHASES  # inside the probe's ranges


def test_arrivals_wait_for_the_running_step(tmp_path, identity):
    """A request arriving while a step runs joins the next step; its TTFT counts from its arrival."""
    setup = _setup(tmp_path, identity, {"async_scheduling": False})
    result = run_simulation(setup, [TraceRequest(0.0, 100, 2), TraceRequest(0.005, 50, 2)], progress=False)
    first, second = result.timelines
    assert _ms(first.token_times_s) == [20.0, 35.0]  # step 2 holds the second prefill (50 tokens) and a decode
    assert _ms(second.token_times_s) == [35.0, 45.0]
    report = build_report(result.timelines, model="demo", request_rate=math.inf, burstiness=1.0, dataset="t",
                          seed=0, goodput={"ttft": 25.0})
    assert [round(r["ttft"] * 1000, 6) for r in report["requests"]] == [20.0, 30.0]
    assert [round(r["queueing_time"] * 1000, 6) for r in report["requests"]] == [0.0, 15.0]
    assert report["completed"] == 2 and report["total_output_tokens"] == 4
    assert report["request_goodput"] == pytest.approx(1 / 0.045)  # only the first meets TTFT <= 25 ms


def test_a_small_kv_pool_preempts_and_every_request_completes(tmp_path, identity):
    requests = [TraceRequest(0.0, 120, 60) for _ in range(8)]
    roomy = run_simulation(_setup(tmp_path, identity, {"num_device_blocks": 200}), requests, progress=False)
    tight = run_simulation(_setup(tmp_path, identity, {"num_device_blocks": 24}), requests, progress=False)
    for result in (roomy, tight):
        assert [len(t.token_times_s) for t in result.timelines] == [60] * 8
    assert sum(t.num_preemptions for t in roomy.timelines) == 0
    assert sum(t.num_preemptions for t in tight.timelines) > 0
    assert max(t.finished_s for t in tight.timelines) > max(t.finished_s for t in roomy.timelines)


def test_settings_move_the_prediction(tmp_path, identity):
    """A larger batch finishes a burst sooner when decode steps cost little per row; chunked prefill spreads a
    long prompt over more steps, so its first token comes later."""
    burst = [TraceRequest(0.0, 32, 40) for _ in range(32)]

    def makespan(**overrides):
        setup = _setup(tmp_path, identity, overrides, decode_row_ms=0.2)
        return max(t.finished_s for t in run_simulation(setup, burst, progress=False).timelines)

    assert makespan(max_batch_size=32) < makespan(max_batch_size=4)

    def ttft(**overrides):
        setup = _setup(tmp_path, identity, overrides)
        return run_simulation(setup, [TraceRequest(0.0, 1000, 2)], progress=False).timelines[0].token_times_s[0]

    assert ttft(split_fuse_token_num=128) > ttft(split_fuse_token_num=0)


def test_a_fit_of_another_model_is_refused(tmp_path, identity):
    path = tmp_path / "fit.json"
    linear_fit({**identity, "hidden_size": identity["hidden_size"] * 2}).save(path)
    with pytest.raises(ProfileError, match=f"{path}: profiled for another configuration .*hidden_size"):
        prepare("demo", None, {"dtype": "float32"}, path)
    with pytest.raises(ProfileError, match="dtype: profile 'float32', engine 'bfloat16'"):
        check_identity(linear_fit(identity), {**identity, "dtype": "bfloat16"}, "fit.json")


def test_a_request_longer_than_the_model_is_refused(tmp_path, identity):
    setup = _setup(tmp_path, identity)
    too_long = setup.layout.max_token_len
    with pytest.raises(TraceError, match=r"t.jsonl: request 1 \(line 2\): prompt_len \+ output_len"):
        run_simulation(setup, [TraceRequest(0.0, 10, 2), TraceRequest(1.0, too_long, 1)], progress=False,
                       source="t.jsonl")


def test_speculation_runs_through_the_schedulers_verify_and_rollback(tmp_path, identity):
    """Four drafts a step: accepted every time, a 21-token request takes its prefill and 4 verify steps of 5
    tokens; never accepted, it takes as many steps as without speculation; half accepted, about half."""
    request = [TraceRequest(0.0, 100, 21)]
    plain = run_simulation(_setup(tmp_path, identity), request, progress=False)
    assert len(plain.steps) == 21 and plain.spec_stats is None

    def run(rates):
        setup = prepare("demo", None, {"dtype": "float32", "ngram_step_num": 4}, tmp_path / "fit.json",
                        spec_acceptance=rates)
        return run_simulation(setup, request, progress=False)

    always = run((1.0, 1.0, 1.0, 1.0))
    assert len(always.steps) == 5 and [len(t.token_times_s) for t in always.timelines] == [21]
    assert always.spec_stats.mean_accepted_length == 5.0 and always.spec_stats.acceptance_rate == 1.0
    never = run((0.0, 0.0, 0.0, 0.0))
    assert len(never.steps) == 21 and never.spec_stats.spec_draft_hit_num == 0
    assert never.timelines[0].finished_s > plain.timelines[0].finished_s  # verify rows cost more than decodes

    many = [TraceRequest(0.0, 50, 200) for _ in range(4)]
    setup = prepare("demo", None, {"dtype": "float32", "mtp_step_num": 1, "spec_max_batch_size": 0},
                    tmp_path / "fit.json", spec_acceptance=(0.5,))
    half = run_simulation(setup, many, progress=False)
    assert [len(t.token_times_s) for t in half.timelines] == [200] * 4
    assert half.spec_stats.acceptance_rate == pytest.approx(0.5, abs=0.06)


@pytest.mark.parametrize("overrides, rates, message", [
    ({"ngram_step_num": 2}, (), "acceptance rate of each draft position"),
    ({}, (0.5,), "needs speculative decoding on"),
    ({"ngram_step_num": 3}, (0.9, 0.8), "need an acceptance rate for each of 3"),
])
def test_simulating_speculation_needs_matching_acceptance_rates(tmp_path, identity, overrides, rates, message):
    path = tmp_path / "fit.json"
    linear_fit(identity).save(path)
    with pytest.raises(ValueError, match=message):
        prepare("demo", None, {"dtype": "float32", **overrides}, path, spec_acceptance=rates)
