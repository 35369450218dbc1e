"""``ksana serve --step-log``: one line per step, whose shapes account for every token the requests computed."""

from __future__ import annotations

from ksana.scheduler.step_log import read_step_log
from tests.server.conftest import ServerProcess


def test_the_step_log_holds_every_step_with_its_shape_and_times(tmp_path):
    path = tmp_path / "steps.jsonl"
    prompts = [[100 + i + j for j in range(9 + 5 * i)] for i in range(3)]
    max_tokens = 6
    server = ServerProcess("--model", "demo", "--dtype", "float32", "--step-log", str(path)).wait_ready()
    try:
        for prompt in prompts:
            response = server.client.post("/v1/completions", json={
                "model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
            assert response.status_code == 200, response.text
    finally:
        server.close()
    steps = read_step_log(path)
    # A request computes its prompt, then one token per step for every output token but the last.
    assert sum(q for step in steps for q, _ in step.rows) == sum(len(p) + max_tokens - 1 for p in prompts)
    assert sorted(c for step in steps for q, c in step.rows if q > 1) == sorted(len(p) for p in prompts)
    assert [step.step_id for step in steps] == sorted(step.step_id for step in steps)
    for step in steps:
        assert step.planned_at <= step.started_at < step.finished_at <= step.result_at
        assert 0 < step.forward_s <= step.duration_s
    # Each request arrives once, in the step that begins its prompt, received before that step was planned.
    arrivals = [(step, index, at) for step in steps for index, at in step.arrivals]
    assert sorted(step.rows[index] for step, index, _ in arrivals) == sorted((len(p), len(p)) for p in prompts)
    assert all(at <= step.planned_at for step, _, at in arrivals)
    # Each row names its request: a request's rows, step after step, hold its prompt and then one token a step.
    assert all(len(step.request_ids) == len(step.rows) for step in steps)
    by_request: dict[str, list[tuple[int, int]]] = {}
    for step in steps:
        for request_id, row in zip(step.request_ids, step.rows, strict=True):
            by_request.setdefault(request_id, []).append(row)
    assert sorted(rows[0] for rows in by_request.values()) == sorted((len(p), len(p)) for p in prompts)
    assert all(rows[1:] == [(1, rows[0][1] + k) for k in range(1, max_tokens)] for rows in by_request.values())
