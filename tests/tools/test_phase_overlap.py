"""``tools/phase_overlap.py`` on the demo model: every schedule of a captured decode step's phases is timed.

No timing thresholds (the figures are the benchmark's business): what can fail is the capture, the bookkeeping of
the rounds and the medians, the bytes the attention is said to read, and the overlapped runs doing the work (the
projections' outputs must be the bits one call on all threads gives).
"""

from __future__ import annotations

import statistics

import pytest
import torch
from transformers import AutoConfig

from ksana.builtin import resolve_model_dir
from ksana.models.shape import ModelShape
from tests.tools import load_tool, require_fused_decode


@pytest.fixture(scope="module")
def bench():
    return load_tool("phase_overlap")


def test_every_schedule_is_timed_and_the_overlapped_runs_do_the_work(bench):
    require_fused_decode()
    settings = bench.QUICK
    report = bench.run_bench(settings)
    assert report["same_bits"] is True
    assert set(report["median_ms"]) == set(bench.CASES)
    for name, rounds in report["rounds_ms"].items():
        assert len(rounds) == settings.rounds
        assert report["median_ms"][name] == pytest.approx(statistics.median(rounds))
    ms = report["median_ms"]
    assert report["sequential_ms"] == pytest.approx(ms["attention_all"] + ms["projections_all"])
    assert report["overlapped_over_sequential"] == pytest.approx(ms["overlapped"] / report["sequential_ms"])
    assert report["sequential_over_fused_step"] == pytest.approx(report["sequential_ms"] / ms["fused_step"])
    # the first decode step at the full batch: every sequence holds its prompt and the token being decoded
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(resolve_model_dir(settings.model)), torch.float32)
    per_position = 2 * shape.num_kv_heads * shape.head_dim * 4
    assert report["kv_bytes"] == shape.num_layers * settings.batch * (settings.context + 1) * per_position


def test_a_round_count_below_one_is_refused_by_name(bench, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--rounds", "0"])
    assert exit_info.value.code == 2
    assert "--rounds must be at least 1, got 0" in capsys.readouterr().err
