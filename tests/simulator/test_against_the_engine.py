"""Settings move the simulation the way they move the real engine: a real perf profile of the demo model, then the
same workloads through ``LLM.generate`` and through the simulator, with two settings changed one at a time."""

from __future__ import annotations

import time

import orjson
import pytest

from ksana import LLM, SamplingParams
from ksana.bench.trace import TraceRequest
from ksana.perf.perf_config import ModelPerfConfig
from ksana.perf.runner import run_model_perf
from ksana.simulator.simulate import prepare, run_simulation
from ksana.simulator.sweep import sweep_batches


@pytest.fixture(scope="module")
def demo_profile(tmp_path_factory):
    folder = tmp_path_factory.mktemp("profile")
    batches = {f"batch_{i}": {"dp_0": entries} for i, entries in enumerate(sweep_batches(16, 1024, 0, 1024))}
    (folder / "batch_config.json").write_bytes(orjson.dumps(batches))
    perf = ModelPerfConfig(path=folder / "model_perf_config.json", model_dir="demo",
                           batch_config=folder / "batch_config.json", warmup_rounds=1, stat_rounds=2,
                           output_file=folder / "perf.json", profile_operators=False, layer_forward_round=1)
    run_model_perf(perf, {"dtype": "float32"}, progress=False)
    return folder / "perf.json"


def _measured_s(settings, prompts, output_len) -> float:
    llm = LLM(model="demo", dtype="float32", **settings)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm
    # The best of three: a run takes a fraction of a second, which one stall of a shared core can double.
    times = []
    for _ in range(3):
        started = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - started)
    return min(times)


def _simulated_s(profile, settings, prompts, output_len) -> float:
    setup = prepare("demo", None, {"dtype": "float32", **settings}, profile)
    trace = [TraceRequest(0.0, len(p), output_len, tuple(p)) for p in prompts]
    return max(t.finished_s for t in run_simulation(setup, trace, progress=False).timelines)


def test_a_larger_batch_finishes_a_burst_sooner_in_both(demo_profile):
    prompts = [[300 + 7 * i + j for j in range(24)] for i in range(24)]
    small, large = {"max_batch_size": 2}, {"max_batch_size": 16}
    measured = _measured_s(small, prompts, 24) / _measured_s(large, prompts, 24)
    simulated = _simulated_s(demo_profile, small, prompts, 24) / _simulated_s(demo_profile, large, prompts, 24)
    assert measured > 1.5 and simulated > 1.5


def test_the_prefix_cache_shortens_shared_prompts_in_both(demo_profile):
    shared = [400 + (i % 500) for i in range(800)]
    prompts = [shared + [900 + i, 901 + i] for i in range(12)]
    off, on = {"enable_auto_prefix_cache": False}, {"enable_auto_prefix_cache": True}
    measured = _measured_s(off, prompts, 2) / _measured_s(on, prompts, 2)
    simulated = _simulated_s(demo_profile, off, prompts, 2) / _simulated_s(demo_profile, on, prompts, 2)
    assert measured > 1.5 and simulated > 1.5
