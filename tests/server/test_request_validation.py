"""Requests vLLM's OpenAI server refuses are refused here too, in OpenAI's error form, through the ``openai`` client
(raw HTTP where the client would not send them); the server keeps serving after each one."""

from __future__ import annotations

import openai
import pytest

from ksana.sampling_params import SamplingParams, SamplingParamsError

PROMPT = "Once upon a time there was"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def card(server):
    return server.client.get("/v1/models").json()["data"][0]


def assert_healthy(server, client) -> None:
    assert server.client.get("/health").json() == {"status": "healthy"}
    result = client.completions.create(model="demo", prompt=PROMPT, max_tokens=2, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert result.usage.completion_tokens == 2


def assert_error(error: openai.APIStatusError, status: int, param: str | None, *in_message: str) -> None:
    assert error.status_code == status
    assert set(error.body) == {"message", "type", "param", "code"}
    assert error.body["type"] == "invalid_request_error" and error.body["param"] == param
    for text in in_message:
        assert text in error.body["message"], (text, error.body["message"])


# ---- max_tokens beyond the context left after the prompt ----------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_completion_max_tokens_beyond_the_context_is_400(client, server, card, stream):
    context = card["max_model_len"]
    prompt = [7] * (context - 8)  # 8 tokens of room
    fits = client.completions.create(model="demo", prompt=prompt, max_tokens=8, temperature=0)
    assert fits.usage.prompt_tokens == context - 8 and fits.usage.completion_tokens <= 8
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="demo", prompt=prompt, max_tokens=9, temperature=0, stream=stream)
    assert_error(info.value, 400, "max_tokens", f"maximum context length is {context} tokens",
                 f"{context - 8} input tokens", "'max_tokens' is too large: 9")
    assert info.value.body["code"] == "context_length_exceeded"
    # One prompt of several that does not leave the room fails the request.
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="demo", prompt=[[7, 8], prompt], max_tokens=9, temperature=0)
    assert_healthy(server, client)


def test_chat_max_tokens_and_max_completion_tokens_beyond_the_context_are_400(client, server, card):
    context = card["max_model_len"]
    num_prompt = server.client.post("/tokenize", json={"messages": MESSAGES}).json()["count"]
    room = context - num_prompt
    for param in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="demo", messages=MESSAGES, **{param: room + 1})
        assert_error(info.value, 400, param, f"'{param}' is too large: {room + 1}",
                     f"maximum context length is {context} tokens", f"{num_prompt} input tokens")
    assert_healthy(server, client)


# ---- stop_token_ids outside the vocabulary ------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["vocab", -1])
def test_stop_token_ids_outside_the_vocabulary_are_400(client, server, card, bad):
    vocab = card["vocab_size"]
    token_id = vocab if bad == "vocab" else bad
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="demo", prompt=PROMPT, max_tokens=3, extra_body={"stop_token_ids": [5, token_id]})
    assert_error(info.value, 400, "stop_token_ids", f"token id {token_id}", f"vocabulary size {vocab}")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=3,
                                       extra_body={"stop_token_ids": [token_id]})
    assert_error(info.value, 400, "stop_token_ids", f"token id {token_id}")
    response = server.client.post("/generate", json={"prompt": PROMPT, "stream": False, "sampling_config": {
        "max_new_tokens": 3, "stop_token_ids": [token_id]}})
    assert response.status_code == 400 and f"token id {token_id}" in response.json()["error"]["message"]
    # The last id of the vocabulary is a valid stop token.
    ok = client.completions.create(model="demo", prompt=PROMPT, max_tokens=3, extra_body={"stop_token_ids": [vocab - 1]})
    assert ok.choices[0].finish_reason in ("length", "stop")
    assert_healthy(server, client)


# ---- stream_options ----------------------------------------------------------------------------------------------
def test_stream_options_without_stream_is_400(client, server):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="demo", prompt=PROMPT, max_tokens=3, stream=False,
                                  stream_options={"include_usage": True})
    assert_error(info.value, 400, "stream_options", "stream_options can only be set when stream is true")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=3,
                                       stream_options={"include_usage": False})
    assert_error(info.value, 400, "stream_options", "stream_options can only be set when stream is true")
    assert_healthy(server, client)


def test_include_usage_null_reads_as_absent(client):
    chunks = list(client.completions.create(model="demo", prompt=PROMPT, max_tokens=4, temperature=0, stream=True,
                                            stream_options={"include_usage": None}))
    assert all(c.usage is None and len(c.choices) == 1 for c in chunks)
    with_usage = list(client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=4, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
    assert with_usage[-1].choices == [] and with_usage[-1].usage.completion_tokens == 4
    plain = list(client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=4, temperature=0,
                                                stream=True, stream_options={"include_usage": None}))
    assert all(c.choices for c in plain)
    assert "".join(c.choices[0].delta.content or "" for c in plain) == "".join(
        c.choices[0].delta.content or "" for c in with_usage[:-1])


# ---- seed --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [2**63, 2**64 - 1, -(2**63) - 1])
def test_seed_outside_signed_64_bits_is_400(client, server, seed):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="demo", prompt=PROMPT, max_tokens=3, seed=seed)
    assert_error(info.value, 400, "seed")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=3, seed=seed)
    assert_error(info.value, 400, "seed")
    assert_healthy(server, client)


def test_seeds_at_the_signed_64_bit_bounds_are_accepted(client):
    for seed in (2**63 - 1, -(2**63)):
        first = client.completions.create(model="demo", prompt=PROMPT, max_tokens=5, seed=seed)
        again = client.completions.create(model="demo", prompt=PROMPT, max_tokens=5, seed=seed)
        assert first.choices[0].text == again.choices[0].text  # seeded: the same sample
    with pytest.raises(SamplingParamsError, match="seed"):
        SamplingParams(seed=2**63)  # the offline API takes the same range


# ---- Content-Type ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/generate", "/tokenize"])
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_a_body_not_declared_json_is_415(client, server, route, content_type):
    body = b'{"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": false}'
    response = server.client.post(route, content=body, headers={"content-type": content_type})
    assert response.status_code == 415
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "unsupported_media_type" and content_type in error["message"]
    assert_healthy(server, client)


@pytest.mark.parametrize("content_type", [None, "application/json", "application/json; charset=utf-8",
                                          "Application/JSON", "application/vnd.api+json"])
def test_json_content_types_are_read(server, content_type):
    headers = {"content-type": content_type} if content_type else {}
    response = server.client.post("/v1/completions", content=b'{"prompt": "hi", "max_tokens": 2}', headers=headers)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] > 0
