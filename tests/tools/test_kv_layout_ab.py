"""``tools/kv_layout_ab.py`` on the demo model: both cache layouts run the captured step, with the same bits.

No timing thresholds (the figures are the benchmark's business): what can fail is the capture, the copy to the other
layout, the bit check and the bookkeeping of the pairs.
"""

from __future__ import annotations

import pytest

from tests.tools import load_tool, require_fused_decode


@pytest.fixture(scope="module")
def bench():
    return load_tool("kv_layout_ab")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_both_layouts_give_the_same_bits_and_every_pair_is_counted(bench, dtype: str):
    require_fused_decode()
    report = bench.run_ab(bench.Settings(model="demo", dtype=dtype, batch=3, context=24, rounds=2))
    assert report["same_bits"] is True and report["layouts_differ"] is True
    assert report["pairs"]["n"] == 4
    assert report["settings"]["dtype"] == dtype


def test_a_round_count_below_one_is_refused_by_name(bench, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--rounds", "0"])
    assert exit_info.value.code == 2
    assert "--rounds must be at least 1, got 0" in capsys.readouterr().err
