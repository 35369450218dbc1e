"""``tools/decode_phases.py`` on the demo model: the clocked build's phases, their costs and floors.

No timing thresholds (the figures are the benchmark's business): what can fail is the clock (phases that add up to
more than the call they were clocked in, or to nothing), the bookkeeping of the steps, and the roofline
arithmetic (the sum of per-phase floors can never be below the bound over the same bytes and FLOPs).
"""

from __future__ import annotations

import pytest
import torch

from ksana.models.shape import ModelShape
from tests.tools import load_tool, require_fused_decode


@pytest.fixture(scope="module")
def bench():
    return load_tool("decode_phases")


@pytest.fixture(scope="module")
def report(bench):
    require_fused_decode()
    return bench.run_bench(bench.QUICK)


def test_every_configuration_is_clocked_inside_its_calls(bench, report):
    settings = bench.QUICK
    assert [(c["batch"], c["context"]) for c in report["configs"]] == [
        (b, ctx) for b in settings.batches for ctx in settings.contexts]
    for cfg in report["configs"]:
        assert cfg["steps"] == settings.tokens - 1 - bench.SKIP_STEPS  # the first token comes from the prefill
        assert list(cfg["phases"]) == [*bench.PHASES, "lm_head"]
        assert 0 < cfg["phases_s"] <= cfg["fused_s"]  # the barriers are inside the call
        assert cfg["outside_phases_s"] == pytest.approx(cfg["fused_s"] - cfg["phases_s"])
        assert all(0 <= row["wait_s"] <= row["s"] for row in cfg["phases"].values() if row["s"] is not None)
        # the clock recorded the phases that do the work
        assert cfg["phases"]["qkv"]["s"] > 0 and cfg["phases"]["attention"]["s"] > 0
        assert cfg["phases"]["lm_head"]["s"] is not None  # greedy rows: the fused lm_head ran and was timed
        assert len(cfg["round_medians_s"]) == settings.rounds


def test_no_phase_beats_its_floor_and_the_floors_cover_the_bound(bench, report):
    ceilings = report["ceilings"]
    assert ceilings["read_bytes_per_s"] >= ceilings["measured_read_bytes_per_s"]
    assert ceilings["matmul_flop_per_s"] >= ceilings["measured_matmul_flop_per_s"]
    for cfg in report["configs"]:
        floors = [row["floor_s"] for row in cfg["phases"].values() if "floor_s" in row]
        assert sum(floors) == pytest.approx(cfg["no_overlap_floor_s"])
        # the ceilings were raised to the fastest phase of any configuration, so none runs below its floor
        assert all(row["over_floor"] >= 1 - 1e-9 for row in cfg["phases"].values() if row.get("over_floor"))
        # max(a/F, b/B) summed over phases >= max(sum a / F, sum b / B); only norms and the embedding's rows
        # (in the bound, in no phase) can make the floor fall short, by far less than 1%
        assert cfg["no_overlap_floor_over_bound"] > 0.99


def test_phase_costs_add_up_to_the_step_cost(bench):
    shape = ModelShape(model_type="llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                       intermediate_size=128, vocab_size=256, max_position_embeddings=512,
                       sliding_windows=[None, None], eos_token_ids=[0], dtype=torch.float32)
    seq_lens = [10, 20, 30]
    costs = bench.phase_costs(shape, len(seq_lens), seq_lens)
    step = bench.decode_step_cost(shape, seq_lens)
    matmul_bytes = sum(costs[p]["bytes"] for p in (*bench.PROJECTIONS, "lm_head"))
    norms_and_rows = ((2 * shape.num_layers + 1) * shape.hidden_size + len(seq_lens) * shape.hidden_size) * 4
    assert matmul_bytes + norms_and_rows == step["weight_bytes"]
    assert costs["attention"]["bytes"] == step["kv_bytes"]
    assert sum(c["flops"] for c in costs.values()) == step["flops"]


def test_a_phase_faster_than_the_measured_ceiling_raises_it(bench):
    measured = {"read_bandwidth": {"bytes_per_s": 10e9, "reader": "sum"},
                "matmul": {"flop_per_s": 100e9, "kernel": "torch.mm"}}
    raised = bench.raised_ceilings(measured, [[(50e9, 12e9), (120e9, 2e9)], [(1e9, 8e9)]])
    assert raised["read_bytes_per_s"] == 12e9 and raised["read_source"] == "a phase"
    assert raised["matmul_flop_per_s"] == 120e9 and raised["matmul_source"] == "a phase"
    kept = bench.raised_ceilings(measured, [[(50e9, 5e9)]])
    assert (kept["read_bytes_per_s"], kept["read_source"]) == (10e9, "sum")
    assert (kept["matmul_flop_per_s"], kept["matmul_source"]) == (100e9, "torch.mm")
