"""Fitting perf results: NNLS recovers a known latency law, reports held-out error against DistServe's
baseline, refuses mixed or malformed profiles, and a real ``ksana perf`` result fits end to end."""

from __future__ import annotations

import random

import orjson
import pytest

from ksana.perf.perf_config import ModelPerfConfig
from ksana.perf.runner import run_model_perf
from ksana.simulator.features import StepShape
from ksana.simulator.fit import LatencyFit, fit_profile, load_fit
from ksana.simulator.latency_model import held_out_error, nnls_relative
from ksana.simulator.profile import ProfileError, load_profile
from ksana.simulator.sweep import sweep_batches

META = {"model": {"model_type": "qwen2", "hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                  "head_dim": 16, "intermediate_size": 128, "vocab_size": 1024, "dtype": "float32"},
        "device": {"type": "cpu", "name": "test cpu", "num_threads": 2}, "git_commit": "abc"}
# worker ms = 2 + 0.05 / prefill token + 1e-5 / attention pair + 0.3 / decode row + 0.01 / decode row squared
# + 2e-4 / decode context token
LAW = (2.0, 0.05, 1e-5, 0.3, 0.01, 2e-4, 0.0)


def _perf_result(batches, law=LAW, noise=0.0, seed=0, meta=META):
    rng = random.Random(seed)
    out = []
    for i, requests in enumerate(batches):
        shape = StepShape.from_perf_requests(requests)
        worker = sum(c * f for c, f in zip(law, shape.features(), strict=True))
        rounds = [{"prepare_ms": 0.1 * worker, "forward_ms": 0.8 * worker * (1 + rng.uniform(-noise, noise)),
                   "sample_ms": 0.1 * worker, "step_ms": worker + 0.5 + 0.01 * len(shape.rows)} for _ in range(3)]
        out.append({"name": f"batch_{i}", "requests": requests, "rounds": rounds})
    return {"meta": meta, "batches": out}


@pytest.fixture
def sweep():
    return sweep_batches(max_batch_size=32, max_step_tokens=2048, split_fuse_token_num=256, max_context=1024)


def test_nnls_recovers_a_known_law_and_beats_the_baseline(tmp_path, sweep):
    path = tmp_path / "perf.json"
    path.write_bytes(orjson.dumps(_perf_result(sweep)))
    fit = fit_profile(load_profile([path]))
    assert fit.worker.model.coef == pytest.approx(LAW, rel=1e-6, abs=1e-9)
    assert fit.worker.held_out.max < 1e-6
    assert fit.baseline.held_out.mean > 10 * fit.worker.held_out.mean + 0.01  # decode context is beyond it
    assert fit.engine.model.predict(StepShape(((1, 100),) * 10).features()) == pytest.approx(0.6)
    assert fit.identity["hidden_size"] == 64 and fit.provenance["git_commit"] == "abc"


def test_held_out_error_sees_a_feature_the_model_lacks():
    """A law with a term no feature carries cannot be predicted on held-out samples."""
    x = [(1.0, float(n)) for n in range(1, 30)]
    y = [1.0 + 2.0 * n + (50.0 if n % 2 else 0.0) for n in range(1, 30)]
    assert held_out_error(x, [1.0 + 2.0 * n for n in range(1, 30)], nnls_relative).max < 1e-9
    assert held_out_error(x, y, nnls_relative).mean > 0.2


def test_a_saved_fit_reads_back_and_a_raw_perf_result_fits_on_the_fly(tmp_path, sweep):
    perf = tmp_path / "perf.json"
    perf.write_bytes(orjson.dumps(_perf_result(sweep, noise=0.05)))
    fit = fit_profile(load_profile([perf]))
    saved = fit.save(tmp_path / "fit.json")
    assert LatencyFit.from_json(orjson.loads(saved.read_bytes())) == fit
    assert load_fit(saved) == fit
    assert load_fit(perf).worker.model == fit.worker.model


def test_profiles_of_two_configurations_do_not_mix(tmp_path, sweep):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_bytes(orjson.dumps(_perf_result(sweep)))
    other = {**META, "model": {**META["model"], "dtype": "bfloat16"}}
    b.write_bytes(orjson.dumps(_perf_result(sweep, meta=other)))
    assert len(load_profile([a, a]).samples) == 2 * len(sweep)
    with pytest.raises(ProfileError, match=f"{b}: another configuration than {a}.*dtype"):
        load_profile([a, b])


@pytest.mark.parametrize("content, message", [
    (b"{not json", "not JSON"),
    (b'{"batches": []}', "not a perf result"),
    (orjson.dumps({"meta": META, "batches": [{"name": "batch_0", "requests": [], "rounds": [{}]}]}),
     "batch batch_0: missing or malformed key 'prepare_ms'"),
])
def test_a_malformed_profile_is_named(tmp_path, content, message):
    path = tmp_path / "perf.json"
    path.write_bytes(content)
    with pytest.raises(ProfileError, match=f"{path}: .*{message}"):
        load_profile([path])


def test_a_real_perf_run_of_the_demo_model_fits(tmp_path):
    batches = {f"batch_{i}": {"dp_0": entries} for i, entries in enumerate(sweep_batches(8, 256, 64, 256))}
    (tmp_path / "batch_config.json").write_bytes(orjson.dumps(batches))
    perf = ModelPerfConfig(path=tmp_path / "model_perf_config.json", model_dir="demo",
                           batch_config=tmp_path / "batch_config.json", runtime_config=None, warmup_rounds=1,
                           stat_rounds=2, output_file=tmp_path / "perf.json", profile_operators=True,
                           layer_forward_round=1, seed=0)
    run_model_perf(perf, {"dtype": "float32"}, progress=False)
    fit = fit_profile(load_profile([tmp_path / "perf.json"]))
    assert fit.identity["model_type"] == "qwen2" and fit.identity["dtype"] == "float32"
    assert set(fit.groups) >= {"projections", "decode_attention", "prefill_attention"}
    assert all(c >= 0 for c in fit.worker.model.coef)
    assert fit.worker.model.predict(StepShape(((256, 256),)).features()) > fit.worker.model.predict(
        StepShape(((1, 256),)).features())


def test_steps_from_a_servers_step_log_fit_their_law_with_a_per_row_cost():
    """``fit_steps`` (the calibration's fit of a probe's step log): 1.5 ms a row more than LAW, which perf mode's
    steps alone would not show, is recovered from mixed and decode steps like a server's."""
    from ksana.simulator.fit import fit_steps

    law = (*LAW[:-1], 1.5)
    rng = random.Random(3)
    shapes = []
    for _ in range(300):
        decodes = [(1, rng.randint(16, 900)) for _ in range(rng.randint(1, 40))]
        prefill = [(q, q + rng.randint(0, 300)) for q in [rng.randint(16, 256)] if rng.random() < 0.3]
        shapes.append(StepShape(tuple(decodes + prefill)))
    worker_ms = [sum(c * x for c, x in zip(law, s.features(), strict=True)) for s in shapes]
    fitted = fit_steps(shapes, worker_ms)
    assert fitted.model.coef == pytest.approx(law, rel=1e-3, abs=1e-6)
    assert fitted.held_out.max < 1e-3
