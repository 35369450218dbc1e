"""``ksana serve --tensor-para-size 2`` answers OpenAI requests as the single-process engine does, and its rank
processes go away with it."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from ksana import LLM, SamplingParams
from tests.server.conftest import ServerProcess


def _children(pid: int) -> list[int]:
    return [int(child) for task in Path(f"/proc/{pid}/task").iterdir()
            for child in (task / "children").read_text().split()]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.fixture(scope="module")
def tp_server():
    process = ServerProcess("--model", "demo", "--tensor-para-size", "2", "--device", "cpu")
    try:
        yield process.wait_ready()
    finally:
        process.close()


def test_openai_completion_matches_single_process_engine(tp_server):
    ranks = _children(tp_server.proc.pid)
    assert len(ranks) == 1  # rank 0 is the server itself

    expected = LLM(model="demo", device="cpu").generate("The quick brown", SamplingParams(temperature=0, max_tokens=16),
                                          use_tqdm=False)[0].outputs[0]
    response = tp_server.client.post("/v1/completions", json={
        "model": "demo", "prompt": "The quick brown", "max_tokens": 16, "temperature": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["text"] == expected.text
    assert body["usage"]["completion_tokens"] == len(expected.token_ids)

    tp_server.proc.terminate()  # as a process manager stops it; the fixture cleans up the rest
    tp_server.proc.wait(20)
    deadline = time.monotonic() + 20
    while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
        os.sched_yield()
    assert not any(_alive(pid) for pid in ranks), "a tensor-parallel rank outlived its server"
