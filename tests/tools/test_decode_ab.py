"""``tools/decode_ab.py`` on the demo model: two builds take turns in one engine, and the bit check can fail.

No timing thresholds (the figures are the benchmark's business): what can fail is the pairing of neighbouring steps,
the bookkeeping of the rounds, and the check that two builds give the same bits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from ksana.kernels.cpu import build, load_library
from ksana.kernels.cpu.ops import NativeCPUOps

from tests.tools import load_tool

NORM_LINE = "float inv = 1.0f / sqrtf(ss / (float)dim + eps);"


@pytest.fixture(scope="module")
def bench():
    return load_tool("decode_ab")


def _settings(bench, b_source: Path):
    return bench.Settings(a_source=build.SOURCE, b_source=b_source, model="demo", batch=3, context=24, tokens=10,
                          rounds=2)


def test_one_source_against_itself_pairs_neighbouring_steps_and_gives_the_same_bits(bench):
    report = bench.run_ab(_settings(bench, build.SOURCE))
    if not NativeCPUOps(load_library()).has_linear:  # no fused decode step to compare on this CPU
        assert "no fused decode step" in report["error"]
        return
    assert report["same_bits"] is True
    assert len(report["rounds"]) == 2
    for r in report["rounds"]:
        assert r["a_ms"] > 0 and r["b_ms"] > 0 and r["pair_ratios"] and all(x > 0 for x in r["pair_ratios"])
    pairs = report["pairs"]
    assert pairs["n"] == sum(len(r["pair_ratios"]) for r in report["rounds"])
    assert pairs["q1"] <= pairs["median_b_over_a"] <= pairs["q3"]
    assert report["sources"]["a"]["sha256"] == report["sources"]["b"]["sha256"]


def test_a_build_that_rounds_differently_is_reported(bench, tmp_path):
    source = build.SOURCE.read_text()
    assert NORM_LINE in source  # the line this test perturbs (RMSNorm's epsilon, doubled)
    changed = tmp_path / "ksana_cpu_changed.c"
    changed.write_text(source.replace(NORM_LINE, NORM_LINE.replace("+ eps", "+ 2 * eps")))
    report = bench.run_ab(_settings(bench, changed))
    if not NativeCPUOps(load_library()).has_linear:
        assert "no fused decode step" in report["error"]
        return
    assert report["same_bits"] is False
    assert report["sources"]["a"]["sha256"] != report["sources"]["b"]["sha256"]
