"""Prompt lookup on the real model: where the text repeats, most drafts are accepted and the engine takes fewer
steps for the same greedy output; a stop string that cuts a verify row's tokens leaves no block taken; a server's
/metrics counts the drafts."""

from __future__ import annotations

import openai
import pytest

from ksana import LLM, SamplingParams
from tests.server.conftest import ServerProcess

REPETITIVE = [
    "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3,",
    "Monday, Tuesday, Wednesday, Monday, Tuesday, Wednesday, Monday, Tuesday,",
    "<li>apple</li>\n<li>pear</li>\n<li>apple</li>\n<li>pear</li>\n<li>apple</li>\n",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40)


@pytest.fixture(scope="module")
def plain_and_spec():
    plain = LLM(model="smollm2", max_batch_size=8)
    spec = LLM(model="smollm2", max_batch_size=8, ngram_step_num=4)
    return plain, spec


def test_repetitive_text_accepts_most_drafts_in_fewer_steps(plain_and_spec):
    plain, spec = plain_and_spec
    expected = plain.generate(REPETITIVE, GREEDY, use_tqdm=False)
    steps_before = spec.engine.scheduler.stats.num_steps
    results = spec.generate(REPETITIVE, GREEDY, use_tqdm=False)
    assert [r.outputs[0].token_ids for r in results] == [r.outputs[0].token_ids for r in expected]
    stats = spec.spec_decoding_stats
    assert stats.acceptance_rate > 0.5, stats
    assert stats.mean_accepted_length > 2.0, stats
    assert spec.engine.scheduler.stats.num_steps - steps_before < 0.7 * plain.engine.scheduler.stats.num_steps


def test_a_stop_string_inside_accepted_drafts_frees_every_block(plain_and_spec):
    _, spec = plain_and_spec
    params = SamplingParams(temperature=0.0, max_tokens=40, stop=["3, 4, 5, 1"])
    result = spec.generate(REPETITIVE[0], params, use_tqdm=False)[0]
    assert result.outputs[0].finish_reason == "stop"
    assert result.outputs[0].text == " 4, 5, 1, 2, "
    assert spec.engine.cache_manager.num_free_blocks == spec.engine.num_blocks


def test_server_reports_draft_counts_in_metrics():
    server = ServerProcess("--model", "smollm2", "--ngram-step-num", "3").wait_ready()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
        stream = client.completions.create(model="smollm2", prompt=REPETITIVE[0], max_tokens=30, temperature=0,
                                           stream=True)
        text = "".join(chunk.choices[0].text for chunk in stream)
        assert text.strip().startswith("4, 5")
        metrics = server.wait_metrics(lambda m: m.get("spec_draft_token_num_total", 0) > 0)
        assert 0 < metrics["spec_draft_hit_num_total"] <= metrics["spec_draft_token_num_total"]
        assert metrics["spec_mean_accepted_length"] > 1.0
        assert metrics["block_manager_free_block_num"] == metrics["block_manager_total_block_num"]
    finally:
        server.close()
