"""``tools/decode_ab.py`` on the demo model: two builds take turns in one engine, and the bit check can fail.

No timing thresholds (the figures are the benchmark's business): what can fail is the pairing of neighbouring steps,
the bookkeeping of the rounds, and the check that two builds give the same bits.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ksana.kernels.cpu import build
from tests.tools import load_tool, require_compiler, require_fused_decode

FINISH_LINE = "float inv = sums[g] > 0.f ? 1.0f / sums[g] : 0.f;"


@pytest.fixture(scope="module")
def bench():
    return load_tool("decode_ab")


def _settings(bench, b_source: Path):
    return bench.Settings(a_source=build.SOURCE, b_source=b_source, model="demo", batch=3, context=24, tokens=10,
                          rounds=2)


def test_one_source_against_itself_pairs_neighbouring_steps_and_gives_the_same_bits(bench):
    require_fused_decode()
    report = bench.run_ab(_settings(bench, build.SOURCE))
    assert report["same_bits"] is True
    assert len(report["rounds"]) == 2
    assert all(r["pair_ratios"] for r in report["rounds"])
    assert report["pairs"]["n"] == sum(len(r["pair_ratios"]) for r in report["rounds"])
    assert report["sources"]["a"]["sha256"] == report["sources"]["b"]["sha256"]


def test_pairs_are_neighbouring_calls_of_one_build_each(bench):
    calls = [("a", 1.0), ("b", 2.0), ("b", 3.0), ("a", 6.0), ("a", 1.0), ("a", 9.0), ("b", 4.0)]
    assert bench._pairs(calls) == [2.0, 0.5]  # b over a either way round; (a, a) is no pair; the last is left


def test_a_cpu_without_the_fused_step_is_reported(bench, monkeypatch):
    require_compiler()
    monkeypatch.setenv("KSANA_CPU_KERNELS", "portable")  # the plain C build: no packed linear, no fused step
    report = bench.run_ab(_settings(bench, build.SOURCE))
    assert "no fused decode step" in report["error"]


def test_a_build_that_rounds_differently_is_reported(bench, tmp_path):
    require_fused_decode()
    source = build.SOURCE.read_text()
    assert FINISH_LINE in source  # the line this test perturbs (the attention softmax's normaliser)
    changed = tmp_path / "ksana_cpu_changed.c"
    changed.write_text(source.replace(FINISH_LINE, FINISH_LINE.replace("1.0f / sums[g]", "1.001f / sums[g]")))
    report = bench.run_ab(_settings(bench, changed))
    assert report["same_bits"] is False
    assert report["sources"]["a"]["sha256"] != report["sources"]["b"]["sha256"]
