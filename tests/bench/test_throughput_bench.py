"""``bench/throughput.py``'s ``transformers`` baseline on the demo model: which prompts it runs and what it counts.

No timing thresholds (the figures are the benchmark's business): what can fail here is the bookkeeping of
``--hf-batches``, which runs the baseline on its first static batches only.
"""

from __future__ import annotations

import sys

import pytest
import torch

from ksana.builtin import resolve_model_dir
from tests.bench import load_bench

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16]]
OUTPUTS = [3, 5, 2, 4, 6]


@pytest.fixture(scope="module")
def bench():
    return load_bench("throughput")


def test_the_baseline_runs_every_prompt_by_default(bench):
    result = bench.run_hf(resolve_model_dir("demo"), torch.float32, PROMPTS, OUTPUTS, batch_size=2)
    assert result["num_prompts"] == len(PROMPTS) and result["output_tokens"] == sum(OUTPUTS)
    assert result["batch_size"] == 2 and result["output_tok_s"] == result["output_tokens"] / result["seconds"]


def test_hf_batches_runs_the_first_static_batches_only(bench):
    result = bench.run_hf(resolve_model_dir("demo"), torch.float32, PROMPTS, OUTPUTS, batch_size=2, max_batches=2)
    assert result["num_prompts"] == 4 and result["output_tokens"] == sum(OUTPUTS[:4])


def test_hf_batches_below_one_is_refused_by_name(bench, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["throughput.py", "--hf-batches", "0"])
    with pytest.raises(SystemExit) as exited:
        bench.main()
    assert exited.value.code == 2 and "--hf-batches must be at least 1, got 0" in capsys.readouterr().err
