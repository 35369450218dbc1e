"""Prefix caching through the server: the second identical prompt reports cached tokens and the cache metrics."""

from __future__ import annotations

import openai
import pytest

from tests.server.conftest import ServerProcess


@pytest.fixture(scope="module")
def cached_server():
    process = ServerProcess("--model", "demo", "--enable-prefix-caching", "--block-token-num", "8")
    yield process.wait_ready()
    process.close()


def test_repeated_prompt_reports_cached_tokens(cached_server):
    client = openai.OpenAI(base_url=cached_server.url + "/v1", api_key="unused")
    prompt = "the quick brown fox jumps over the lazy dog " * 6
    first = client.completions.create(model="demo", prompt=prompt, max_tokens=4, temperature=0)
    second = client.completions.create(model="demo", prompt=prompt, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    # Every full block of the prompt is shared; the last token is always computed again.
    assert cached == (second.usage.prompt_tokens - 1) // 8 * 8 and cached > 0
    assert second.choices[0].text == first.choices[0].text
    metrics = cached_server.metrics()
    assert metrics["prefix_cache_hit_token_num_total"] == cached
    assert metrics["prefix_cache_hit_block_num"] == cached // 8
    assert metrics["prefix_cache_hit_req_num_total"] == 1
