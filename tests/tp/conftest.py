"""Shared by the tensor-parallel tests: TP engines whose ranks are always stopped."""

from __future__ import annotations

import pytest

from ksana import LLM


@pytest.fixture
def tp_llm():
    """Builds TP=2 engines (CPU unless the test says otherwise) and always stops their ranks, even when the test
    fails."""
    made: list[LLM] = []

    def build(model_dir, **overrides) -> LLM:
        llm = LLM(model=str(model_dir), tensor_para_size=2, **{"device": "cpu", **overrides})
        made.append(llm)
        return llm

    yield build
    for llm in made:
        llm.engine.close()
        assert all(proc.poll() is not None for proc in llm.engine.tp_runner.procs)
