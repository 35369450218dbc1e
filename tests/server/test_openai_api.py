"""The OpenAI routes through the real ``openai`` client (sync and async) against a real server process."""

from __future__ import annotations

import openai
import pytest
import trio

from ksana import SamplingParams

PROMPT = "Once upon a time there was"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def _offline(llm, prompt, params):
    return llm.generate([prompt], params, use_tqdm=False)[0]


def test_models_list(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["demo"]
    assert models[0].owned_by == "ksana-llm"
    assert client.models.retrieve("demo").id == "demo"


def test_greedy_completion_equals_offline_and_counts_usage(client, demo_llm):
    reference = _offline(demo_llm, PROMPT, SamplingParams(temperature=0.0, max_tokens=12))
    result = client.completions.create(model="demo", prompt=PROMPT, max_tokens=12, temperature=0)
    choice = result.choices[0]
    assert result.object == "text_completion" and result.id.startswith("cmpl-")
    assert choice.text == reference.outputs[0].text
    assert choice.finish_reason == reference.outputs[0].finish_reason == "length"
    assert result.usage.prompt_tokens == len(reference.prompt_token_ids)
    assert result.usage.completion_tokens == 12
    assert result.usage.total_tokens == result.usage.prompt_tokens + 12
    assert result.usage.prompt_tokens_details.cached_tokens == 0


def test_streamed_completion_with_usage_equals_the_whole_answer(client):
    whole = client.completions.create(model="demo", prompt=PROMPT, max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model="demo", prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert "".join(c.choices[0].text for c in chunks[:-1]) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"


def test_token_id_prompts_and_several_prompts_in_one_request(client, demo_llm):
    ids = demo_llm.tokenizer(PROMPT)["input_ids"]
    by_ids = client.completions.create(model="demo", prompt=ids, max_tokens=6, temperature=0)
    by_text = client.completions.create(model="demo", prompt=PROMPT, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    both = client.completions.create(model="demo", prompt=[PROMPT, "hello"], max_tokens=6, temperature=0, n=2)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert both.choices[0].text == both.choices[1].text == by_text.choices[0].text


def test_chat_equals_offline_chat_streamed_or_not(client, demo_llm):
    reference = demo_llm.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)[0]
    result = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=10, temperature=0)
    assert result.object == "chat.completion"
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == reference.outputs[0].text
    assert result.usage.prompt_tokens == len(reference.prompt_token_ids)
    chunks = list(client.chat.completions.create(model="demo", messages=MESSAGES, max_completion_tokens=10,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reference.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_samples_are_seeded_like_the_offline_api(client, demo_llm):
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8)
    reference = [o.text for o in _offline(demo_llm, PROMPT, params).outputs]
    result = client.completions.create(model="demo", prompt=PROMPT, n=3, seed=11, max_tokens=8)
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert [c.text for c in result.choices] == reference
    assert len(set(reference)) == 3, "independent samples"
    assert result.usage.completion_tokens == 24
    streamed = {i: "" for i in range(3)}
    for chunk in client.completions.create(model="demo", prompt=PROMPT, n=3, seed=11, max_tokens=8, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert [streamed[i] for i in range(3)] == reference


def test_completion_logprobs(client, demo_llm):
    reference = _offline(demo_llm, PROMPT, SamplingParams(temperature=0.0, max_tokens=5, logprobs=3)).outputs[0]
    result = client.completions.create(model="demo", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = result.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(reference.token_logprobs, abs=1e-5)
    assert "".join(lp.tokens) == result.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 3 <= len(top) <= 4  # the chosen token and the top 3 (greedy: the chosen one is the best)
        assert max(top.values()) == pytest.approx(chosen)


def test_chat_logprobs_and_top_logprobs(client):
    result = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=4, temperature=0,
                                            logprobs=True, top_logprobs=2)
    content = result.choices[0].logprobs.content
    assert len(content) == 4
    assert "".join(entry.token for entry in content) == result.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy picks the best
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.bytes == list(entry.token.encode())


def test_stop_strings_echo_and_extras(client):
    text = client.completions.create(model="demo", prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    stopped = client.completions.create(model="demo", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    assert stopped.choices[0].text == text[: text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    echoed = client.completions.create(model="demo", prompt=PROMPT, max_tokens=12, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + text
    streamed = client.completions.create(model="demo", prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                         stop=[stop])
    assert "".join(c.choices[0].text for c in streamed) == text[: text.index(stop)]
    # vLLM's extras go in the body: top_k=1 is greedy whatever the temperature; min_tokens/ignore_eos hold.
    top1 = client.completions.create(model="demo", prompt=PROMPT, max_tokens=12, temperature=1.3, seed=5,
                                     extra_body={"top_k": 1, "min_p": 0.0, "repetition_penalty": 1.0})
    assert top1.choices[0].text == text
    long = client.completions.create(model="demo", prompt=PROMPT, max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True, "min_tokens": 40, "stop_token_ids": [5]})
    assert long.usage.completion_tokens == 40


def test_beam_search_on_the_openai_route(client, server):
    native = server.client.post("/generate", json={"prompt": PROMPT, "stream": False, "sampling_config": {
        "num_beams": 3, "num_return_sequences": 3, "max_new_tokens": 5}}).json()
    result = client.completions.create(model="demo", prompt=PROMPT, n=3, max_tokens=5,
                                       extra_body={"use_beam_search": True})
    assert [c.text for c in result.choices] == native["texts"]
    streamed = list(client.completions.create(model="demo", prompt=PROMPT, n=3, max_tokens=5, stream=True,
                                              extra_body={"use_beam_search": True}))
    assert [c.choices[0].text for c in streamed] == native["texts"]


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n"),
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": "fox " * 3000}, "prompt"),
    ({"logprobs": 50}, "logprobs"),
])
def test_bad_completion_requests_are_400(client, kwargs, param):
    body = {"model": "demo", "prompt": PROMPT} | kwargs
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**body)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param
    assert info.value.body["type"] == "invalid_request_error" and info.value.body["message"]


def test_bad_chat_requests_unknown_model_and_malformed_json(client, server):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="demo", messages=[], max_tokens=3)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="demo", messages=MESSAGES, top_logprobs=2)  # without logprobs
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=3)
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=MESSAGES, max_tokens=3)
    response = server.client.post("/v1/completions", content=b'{"prompt": "x", ', headers={
        "content-type": "application/json"})
    assert response.status_code == 400
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert server.client.get("/v1/nothing").status_code == 404
    # The server keeps serving after every error.
    assert client.completions.create(model="demo", prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


def test_async_client_streams_and_raises(server):
    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
            whole = await client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=8,
                                                         temperature=0)
            stream = await client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=8,
                                                          temperature=0, stream=True,
                                                          stream_options={"include_usage": True})
            parts, last = [], None
            async for chunk in stream:
                parts.extend(c.delta.content or "" for c in chunk.choices)
                last = chunk
            assert "".join(parts) == whole.choices[0].message.content
            assert last.usage.completion_tokens == 8
            with pytest.raises(openai.BadRequestError):
                await client.completions.create(model="demo", prompt=PROMPT, temperature=-1)
            with pytest.raises(openai.NotFoundError):
                await client.completions.create(model="nope", prompt=PROMPT)

    trio.run(main)


def test_tokenize_and_detokenize(server, demo_llm):
    ids = demo_llm.tokenizer(PROMPT)["input_ids"]
    tokenized = server.client.post("/tokenize", json={"prompt": PROMPT}).json()
    assert tokenized["tokens"] == ids and tokenized["count"] == len(ids)
    assert server.client.post("/detokenize", json={"tokens": ids}).json()["prompt"] == PROMPT
    assert server.client.post("/detokenize", json={"tokens": [10**9]}).status_code == 400
