"""``bench/roofline.py`` on the demo model: the report's structure and the arithmetic that ties its figures together.

No timing thresholds: the machine is shared and the figures are the benchmark's business. What can fail here is
the bookkeeping: a bound below one of its ceilings, a step split whose parts do not add up, a missing key.
"""

from __future__ import annotations

import math
import statistics

import attrs
import orjson
import pytest
import torch

from ksana.models.shape import ModelShape
from tests.bench import load_bench

# Smaller than --quick: two batch sizes at one context, a few decode steps, one or two prefill repeats.
SETTINGS = dict(model="demo", batches=(1, 3), contexts=(24,), decode_tokens=6, decode_passes=2, skip_steps=1,
                prefill_len=32, prefill_repeats={"float32": 2, "bfloat16": 1}, bandwidth_mib=16, gemm_n=256,
                ceiling_repeats=2)


@pytest.fixture(scope="module")
def bench():
    return load_bench("roofline")


@pytest.fixture(scope="module")
def report(bench):
    return bench.run_bench(bench.Settings(**SETTINGS))


def test_ceilings_are_measured_and_positive(report):
    c = report["ceilings"]
    assert c["read_bandwidth"]["bytes_per_s"] > 0 and c["matmul"]["flop_per_s"] > 0
    assert c["read_bandwidth"]["bytes"] == SETTINGS["bandwidth_mib"] * 2**20
    assert c["matmul"]["n"] == SETTINGS["gemm_n"]


def test_the_read_ceiling_is_the_fastest_reader_the_engines_one_row_stream_among_them(report):
    for run in report["ceiling_runs"]:
        read = run["read_bandwidth"]
        rates = read["by_reader_bytes_per_s"]
        assert set(rates) == {"sum", "mv", "linear 1 row"}
        assert read["bytes_per_s"] == max(rates.values()) and rates[read["reader"]] == read["bytes_per_s"]
        # The kernel's reading is the one-row streamed matmul of the same run, not another measurement.
        assert rates["linear 1 row"] == run["streamed_matmul"]["1"]["bytes_per_s"]
    kept = report["ceilings"]["read_bandwidth"]
    assert kept["measured_bytes_per_s"] == max(r["read_bandwidth"]["bytes_per_s"] for r in report["ceiling_runs"])


def test_the_matmul_ceiling_is_the_faster_of_torchs_gemm_and_the_engines(report):
    from ksana.kernels.dispatch import get_ops

    kernels = {"torch.mm", "packed linear"} if get_ops("cpu").pack_weights is not None else {"torch.mm"}
    for run in report["ceiling_runs"]:
        matmul = run["matmul"]
        assert set(matmul["by_kernel_flop_per_s"]) == kernels
        assert matmul["flop_per_s"] == max(matmul["by_kernel_flop_per_s"].values())
        assert matmul["by_kernel_flop_per_s"][matmul["kernel"]] == matmul["flop_per_s"]
    best = max(r["matmul"]["flop_per_s"] for r in report["ceiling_runs"])
    assert report["ceilings"]["matmul"]["flop_per_s"] == best


def test_the_projection_kernel_is_timed_streaming_at_every_batchs_row_count(report):
    streamed = report["ceilings"]["streamed_matmul"]
    assert sorted(streamed) == sorted(str(b) for b in SETTINGS["batches"])
    hidden = report["shape"]["hidden_size"]
    for rows, m in streamed.items():
        assert m["rows"] == int(rows) and m["in_features"] == hidden
        # Whole rows of `hidden` float32 columns, as close under the setting's size as they fit.
        assert SETTINGS["bandwidth_mib"] * 2**20 - 4 * hidden < m["bytes"] <= SETTINGS["bandwidth_mib"] * 2**20
        assert m["bytes_per_s"] == pytest.approx(m["bytes"] / m["best_s"])
    # The best of the runs: no single run saw a faster stream than the one kept.
    for run in report["ceiling_runs"]:
        for rows, m in run["streamed_matmul"].items():
            assert m["bytes_per_s"] <= streamed[rows]["bytes_per_s"]


def test_decode_rows_cover_every_batch_and_context_and_bound_each_ceiling(report):
    decode = report["decode"]
    assert sorted((d["batch"], d["context"]) for d in decode) == [(1, 24), (3, 24)]
    bandwidth = report["ceilings"]["read_bandwidth"]["bytes_per_s"]
    rate = report["ceilings"]["matmul"]["flop_per_s"]
    for d in decode:
        assert d["num_steady_steps"] >= 1
        assert d["bound_s"] >= d["memory_s"] > 0 and d["bound_s"] >= d["compute_s"] > 0
        # The middle step's cost divided by the ceilings lands between the first and last steps' bounds.
        assert d["bytes_per_step"] / bandwidth == pytest.approx(d["memory_s"], rel=0.2)
        assert d["flops_per_step"] / rate == pytest.approx(d["compute_s"], rel=0.2)
        assert d["step_ratio"] > 0 and d["worker_ratio"] > 0
        assert 0 < d["pct_of_roofline"]
        assert d["pct_of_roofline"] == pytest.approx(100 / d["step_ratio"])  # the same median, inverted
        # The kernel bound: weights at this batch's streamed-matmul rate, KV at the read rate.
        stream = report["ceilings"]["streamed_matmul"][str(d["batch"])]["bytes_per_s"]
        kernel = d["weight_bytes_per_step"] / stream + d["kv_bytes_per_step"] / bandwidth
        assert d["kernel_bound_s"] == pytest.approx(kernel, rel=0.2)
        assert d["step_kernel_ratio"] == pytest.approx(d["step_s"] / d["kernel_bound_s"], rel=0.5)
        assert 0 < d["forward_s"] <= d["worker_step_s"] <= d["step_s"]  # nested spans, per step and so in medians
        # A decode step's sequences are past their prompt: context + 1 (first token) onwards.
        assert d["mean_seq_len"] > d["context"]
        assert d["tokens_out_step_s"] > 0, "one TokensOut per decode step, found in its StepResult's handling"


def test_each_decode_row_is_the_fastest_of_its_passes(report):
    for d in report["decode"]:
        passes = d["passes_step_s"]
        assert len(passes) == SETTINGS["decode_passes"] and all(p > 0 for p in passes)
        assert d["step_s"] == passes[d["pass_kept"]] == min(passes)


def test_overhead_parts_add_up_to_the_step_and_stay_inside_it(report):
    # The largest batch at each context, and again with one step in flight (async scheduling off).
    assert set(report["overhead"]) == {"batch3_ctx24", "batch3_ctx24_one_in_flight"}
    one = report["decode_one_in_flight"]
    assert (one["batch"], one["context"]) == (3, 24) and one["num_steady_steps"] >= 1 and one["step_ratio"] > 0
    for o in report["overhead"].values():
        parts = o["parts"]
        assert set(parts) == {"prepare_s", "forward_s", "sample_s", "worker_other_s", "wait_for_plan_s"}
        assert math.fsum(parts.values()) == pytest.approx(o["period_s"], rel=1e-9, abs=1e-12)
        for name, seconds in parts.items():
            assert seconds >= 0, name
        outside = o["period_s"] - parts["forward_s"]
        assert o["outside_forward_s"] == pytest.approx(outside)
        assert 0 < o["outside_forward_pct"] < 100
        assert o["scheduler_s"] > 0, "the scheduler handles one StepResult per step"
        assert o["io_tokens_out_s"] > 0, "the I/O actor handles one TokensOut per step"
        assert o["outside_forward_with_io_pct"] > o["outside_forward_pct"]


def test_prefill_compares_both_dtypes_against_transformers(report):
    assert set(report["prefill"]) == {"float32", "bfloat16"}
    for name, p in report["prefill"].items():
        assert p["prompt_len"] == SETTINGS["prefill_len"]
        k, h = p["ksana"], p["hf"]
        assert 0 < k["forward_s"] <= k["worker_step_s"] and k["tok_s"] == pytest.approx(32 / k["worker_step_s"])
        assert h["tok_s"] == pytest.approx(32 / h["forward_s"]) and h["best_s"] <= h["forward_s"]
        assert p["ratio"] == pytest.approx(k["tok_s"] / h["tok_s"])
        assert len(k["runs_s"]) == len(h["runs_s"]) == SETTINGS["prefill_repeats"][name]
        assert k["best_s"] <= k["worker_step_s"] and p["best_ratio"] == pytest.approx(h["best_s"] / k["best_s"])


def test_step_cost_follows_the_shape(bench):
    import torch

    shape = ModelShape(model_type="llama", num_layers=2, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4,
                       intermediate_size=16, vocab_size=100, max_position_embeddings=64,
                       sliding_windows=[None, 5], eos_token_ids=[], dtype=torch.float32)
    # Per layer: q and o 8x8, k and v 8x4, MLP 3 x 8x16; plus the 100x8 lm_head.
    assert bench.matmul_params(shape) == 2 * (2 * 64 + 2 * 32 + 3 * 128) + 800
    cost = bench.decode_step_cost(shape, [10, 3])
    kv_lens = 10 + 3 + 5 + 3  # the sliding layer reads at most its window
    assert cost["kv_bytes"] == kv_lens * 1 * 4 * 2 * 4
    assert cost["weight_bytes"] == (bench.matmul_params(shape) + 5 * 8 + 2 * 8) * 4  # norms, two embedding rows
    assert cost["flops"] == 2 * bench.matmul_params(shape) * 2 + 4 * kv_lens * 2 * 4
    bound = bench.roofline_bound(cost, bytes_per_s=1e3, flop_per_s=1e12)
    assert bound["bound_s"] == bound["memory_s"] == cost["bytes"] / 1e3
    half = bench.decode_step_cost(attrs.evolve(shape, dtype=torch.bfloat16), [10, 3])
    assert half["bytes"] * 2 == cost["bytes"] and half["flops"] == cost["flops"]
    slow = bench.roofline_bound(cost, bytes_per_s=1e12, flop_per_s=1.0)
    assert slow["bound_s"] == slow["compute_s"] == cost["flops"] > slow["memory_s"]


def test_the_read_ceiling_is_never_below_a_decode_runs_read_rate(bench, report):
    import torch

    read = report["ceilings"]["read_bandwidth"]
    assert read["bytes_per_s"] == max(read["measured_bytes_per_s"], *read["decode_bytes_per_s"].values())
    assert set(read["decode_bytes_per_s"]) == {f"batch{d['batch']}_ctx{d['context']}" for d in report["decode"]}
    # A step that read 1,000 bytes a second against a measured 500: the ceiling is raised to it, and says why.
    shape = ModelShape(model_type="llama", num_layers=1, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4,
                       intermediate_size=16, vocab_size=100, max_position_embeddings=64,
                       sliding_windows=[None], eos_token_ids=[], dtype=torch.float32)
    step_bytes = bench.decode_step_cost(shape, [3])["bytes"]
    decode = [{"batch": 1, "context": 2, "steps": [{"seq_lens": [3], "period_s": step_bytes / 1e3}]}]
    ceilings = {"read_bandwidth": {"bytes_per_s": 500.0}, "matmul": {"flop_per_s": 1.0}}
    raised = bench.raise_to_decode_rate(ceilings, decode, shape)["read_bandwidth"]
    assert raised["bytes_per_s"] == pytest.approx(1e3) and raised["source"] == "decode batch1_ctx2"
    assert raised["measured_bytes_per_s"] == 500.0
    ceilings["read_bandwidth"]["bytes_per_s"] = 2e3
    kept = bench.raise_to_decode_rate(ceilings, decode, shape)["read_bandwidth"]
    assert kept["bytes_per_s"] == 2e3 and kept["source"] == "measured"


def test_each_pass_is_set_against_the_ceilings_measured_beside_it(bench, report):
    import torch

    passes = SETTINGS["decode_passes"]
    assert len(report["ceiling_runs"]) == passes + 1, "once before the first pass and once after each"
    for d in report["decode"]:
        paired = d["paired"]
        assert len(paired["pass_ratios"]) == passes and all(r > 0 for r in paired["pass_ratios"])
        assert paired["median"] == statistics.median(paired["pass_ratios"])
    # Pass 0 ran in a slow minute (both measurements beside it read 100 B/s), pass 1 in a fast one (1,000 after it).
    shape = ModelShape(model_type="llama", num_layers=1, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4,
                       intermediate_size=16, vocab_size=100, max_position_embeddings=64,
                       sliding_windows=[None], eos_token_ids=[], dtype=torch.float32)
    step_bytes = bench.decode_step_cost(shape, [3])["bytes"]

    def run(bytes_per_s: float) -> dict:
        return {"batch": 1, "context": 2, "steps": [{"seq_lens": [3], "period_s": step_bytes / bytes_per_s}]}

    def ceilings(bytes_per_s: float) -> dict:
        return {"read_bandwidth": {"bytes_per_s": bytes_per_s}, "matmul": {"flop_per_s": 1e12},
                "streamed_matmul": {"1": {"bytes_per_s": bytes_per_s}}}

    slow_then_fast = [[run(50.0)], [run(500.0)]]  # each pass read at half its neighbours' ceiling
    paired = bench.paired_ratios(slow_then_fast, [ceilings(100.0), ceilings(100.0), ceilings(1e3)], shape)
    assert paired[0]["pass_ratios"] == pytest.approx([2.0, 2.0])
    assert paired[0]["pass_read_bytes_per_s"] == pytest.approx([100.0, 1e3])
    # Against the run's best ceiling the slow pass would be 20x its bound: a slow minute of the machine.
    assert bench.step_ratio(slow_then_fast[0][0], shape, ceilings(1e3)) == pytest.approx(20.0)
    # A pass that read faster than the measurements beside it raises its own ceiling, as the run's does.
    raised = bench.paired_ratios([[run(300.0)]], [ceilings(100.0), ceilings(200.0)], shape)[0]
    assert raised["pass_ratios"] == pytest.approx([1.0]) and raised["pass_read_bytes_per_s"] == pytest.approx([300.0])
    with pytest.raises(AssertionError, match="one ceiling measurement before each pass"):
        bench.paired_ratios(slow_then_fast, [ceilings(100.0)], shape)


def test_report_is_written_as_json_with_its_keys(bench, report, tmp_path):
    out = tmp_path / "results" / "roofline.json"
    bench.write_report(report, out)
    loaded = orjson.loads(out.read_bytes())
    assert {"model", "ceilings", "shape", "decode", "prefill", "overhead", "settings", "threads"} <= set(loaded)
    assert loaded["shape"]["num_layers"] == 2
    assert loaded["machine"]["torch"] == torch.__version__ and loaded["machine"]["kind"]  # write_json adds it
    text = bench.format_report(report)
    for heading in (f"ceilings (best of {SETTINGS['decode_passes'] + 1}", "decode, float32", "paired", "prefill",
                    "engine overhead"):
        assert heading in text


def test_the_one_row_reader_is_measured_even_where_no_batch_has_one_row(bench):
    settings = bench.Settings(**{**SETTINGS, "batches": (3,), "bandwidth_mib": 8, "gemm_n": 64, "ceiling_repeats": 1})
    ceilings = bench.measure_ceilings(settings, 32)
    assert sorted(ceilings["streamed_matmul"]) == ["3"]
    assert ceilings["read_bandwidth"]["by_reader_bytes_per_s"]["linear 1 row"] > 0
