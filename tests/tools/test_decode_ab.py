"""``tools/decode_ab.py`` on the demo model: two builds take turns in one engine, and the bit check can fail.

No timing thresholds (the figures are the benchmark's business): what can fail is the pairing of neighbouring steps,
the bookkeeping of the rounds, and the check that two builds give the same bits.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ksana.kernels.cpu import build
from tests.tools import changed_kernels, load_tool, require_compiler, require_fused_decode


@pytest.fixture(scope="module")
def bench():
    return load_tool("decode_ab")


def _settings(bench, b_kernels: Path):
    return bench.Settings(a_kernels=build.HERE, b_kernels=b_kernels, model="demo", batch=3, context=24, tokens=10,
                          rounds=2)


def test_one_source_against_itself_pairs_neighbouring_steps_and_gives_the_same_bits(bench):
    require_fused_decode()
    report = bench.run_ab(_settings(bench, build.HERE))
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
    report = bench.run_ab(_settings(bench, build.HERE))
    assert "no fused decode step" in report["error"]


def test_a_build_that_rounds_differently_is_reported(bench, tmp_path):
    require_fused_decode()
    changed = changed_kernels(tmp_path)
    report = bench.run_ab(_settings(bench, changed))
    assert report["same_bits"] is False
    assert report["sources"]["a"]["sha256"] != report["sources"]["b"]["sha256"]
