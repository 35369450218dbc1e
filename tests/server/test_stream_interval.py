"""``ksana serve --stream-interval N``: a choice's first token at once, then N at a time, adding up to the answer."""

from __future__ import annotations

import argparse
import subprocess
import sys

import openai
import pytest

from ksana.server.cli import parse_stream_interval
from tests.server.conftest import ServerProcess

INTERVAL = 4
PROMPT = "Once upon a time there was"


@pytest.fixture(scope="module")
def client():
    process = ServerProcess("--model", "demo", "--dtype", "float32", "--stream-interval", str(INTERVAL))
    with openai.OpenAI(base_url=process.wait_ready().url + "/v1", api_key="unused", max_retries=0) as c:
        yield c
    process.close()


def test_completion_chunks_hold_interval_tokens_after_the_first_and_add_up_to_the_answer(client):
    whole = client.completions.create(model="demo", prompt=PROMPT, max_tokens=12, temperature=0)
    chunks = list(client.completions.create(model="demo", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=0,
                                            stream=True))
    sizes = [len(c.choices[0].logprobs.tokens) for c in chunks]
    assert sum(sizes) == 12
    assert sizes[0] < INTERVAL  # the first token is not held back
    assert all(size >= INTERVAL for size in sizes[1:-1]) and len(sizes) <= 2 + 11 // INTERVAL
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]


def test_chat_choices_stream_in_intervals_each(client):
    messages = [{"role": "user", "content": "Tell me a story."}]
    whole = client.chat.completions.create(model="demo", messages=messages, max_tokens=9, temperature=0, n=2,
                                           logprobs=True)
    stream = client.chat.completions.create(model="demo", messages=messages, max_tokens=9, temperature=0, n=2,
                                            logprobs=True, stream=True)
    texts, sizes = {0: "", 1: ""}, {0: [], 1: []}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.logprobs is not None:
                sizes[choice.index].append(len(choice.logprobs.content))
    for index in (0, 1):
        assert texts[index] == whole.choices[index].message.content
        assert sum(sizes[index]) == 9
        assert all(size >= INTERVAL for size in sizes[index][1:-1])


@pytest.mark.parametrize("text", ["0", "-2", "two"])
def test_a_bad_interval_is_refused_with_a_message(text):
    with pytest.raises(argparse.ArgumentTypeError, match="at least 1"):
        parse_stream_interval(text)


def test_the_cli_names_the_flag():
    result = subprocess.run([sys.executable, "-m", "ksana.cli", "serve", "--model", "demo", "--stream-interval", "0"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "--stream-interval" in result.stderr and "at least 1" in result.stderr
    assert "Traceback" not in result.stderr
