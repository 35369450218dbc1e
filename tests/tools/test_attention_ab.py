"""``tools/attention_ab.py`` on small shapes: two builds' decode attention take turns, and the bit check can fail.

No timing thresholds (the figures are the benchmark's business): what can fail is the bookkeeping of the rounds and
of the bytes, and the check that two builds give the same bits.
"""

from __future__ import annotations

import statistics

import pytest
import torch

from ksana.kernels.cpu import build
from tests.tools import changed_kernels, load_tool, require_compiler


@pytest.fixture(scope="module")
def bench():
    return load_tool("attention_ab")


@pytest.fixture(scope="module")
def current(bench, tmp_path_factory):
    """The working tree's kernels, compiled once for every test here (a build takes seconds)."""
    require_compiler()
    return load_tool("_sources").build_ops(build.HERE, tmp_path_factory.mktemp("attention_ab") / "current")


def _settings(bench, b_kernels, hot=False):
    # batch 8: a task is a whole sequence on up to 4 threads, so every output goes through decode_finish
    return bench.Settings(a_kernels=build.HERE, b_kernels=b_kernels, batch=8, context=40, layers=3, rounds=4,
                          hot=hot)


@pytest.mark.parametrize("hot", [False, True])
def test_one_source_against_itself_agrees_and_counts_the_kv(bench, current, hot):
    report = bench.run_ab(_settings(bench, build.HERE, hot=hot), {"a": current, "b": current})
    assert report["same_bits"] is True
    assert len(report["rounds"]) == 4
    for r in report["rounds"]:
        assert r["b_over_a"] == pytest.approx(r["b_s"] / r["a_s"])
    ratios = report["b_over_a"]
    assert ratios["n"] == 4
    assert ratios["median"] == pytest.approx(statistics.median(r["b_over_a"] for r in report["rounds"]))
    kv_bytes = report["kv_bytes_a_pass"]
    assert kv_bytes == 2 * 8 * 40 * 3 * 64 * 4 * 3  # K and V, batch x context x KV heads x dim
    for name, b in report["builds"].items():
        median_s = statistics.median(r[f"{name}_s"] for r in report["rounds"])
        assert b["median_ms"] == pytest.approx(median_s * 1e3)
        assert b["kv_gb_per_s"] == pytest.approx(kv_bytes / median_s / 1e9)
    assert report["sources"]["a"]["sha256"] == report["sources"]["b"]["sha256"]


def test_a_build_whose_attention_differs_is_reported(bench, current, tmp_path):
    changed = changed_kernels(tmp_path)
    report = bench.run_ab(_settings(bench, changed), {"a": current, "b": load_tool("_sources").build_ops(changed, tmp_path / "b")})
    assert report["same_bits"] is False
    assert report["sources"]["a"]["sha256"] != report["sources"]["b"]["sha256"]


@pytest.mark.parametrize("placement", ["random", "in-order"])
def test_the_block_table_places_every_block_once(bench, placement):
    settings = bench.Settings(a_kernels=build.HERE, b_kernels=build.HERE, batch=4, context=40, layers=1,
                              placement=placement)
    _, table = bench._cache(settings, torch.float32)
    assert table.shape == (4, 3)  # 40 positions: 3 blocks of 16 a sequence
    assert sorted(table.flatten().tolist()) == list(range(12))
    in_order = bool((table.diff(dim=1) == 1).all()) and table[:, 0].tolist() == [0, 3, 6, 9]
    assert in_order is (placement == "in-order")
