"""``echo: true`` with ``logprobs`` on /v1/completions: the prompt's logprobs (OpenAI's legacy shape, the first
token's ``null``) then the completion's, equal to ``transformers``' log-softmax on the served model."""

from __future__ import annotations

import openai
import pytest
import torch

from ksana.builtin import demo_model_dir
from tests.model_factory import load_hf_model

PROMPT = "Once upon a time there was"
TOP = 2
ATOL = 1e-4


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def hf_model():
    return load_hf_model(demo_model_dir(), torch.float32)


def hf_prompt_logprobs(hf_model, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), dim=-1)


def assert_prompt_part(lp, prompt: list[int], tokenizer, hf_model, top: int = TOP) -> None:
    """The first ``len(prompt)`` entries of a legacy logprobs object against transformers."""
    n = len(prompt)
    texts = [tokenizer.decode([t]) for t in prompt]
    assert lp.tokens[:n] == texts
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[:n] == [sum(len(t) for t in texts[:i]) for i in range(n)]
    reference = hf_prompt_logprobs(hf_model, prompt)
    for i in range(1, n):
        expected = reference[i - 1]
        assert lp.token_logprobs[i] == pytest.approx(expected[prompt[i]].item(), abs=ATOL)
        values, ids = expected.topk(top)
        assert set(lp.top_logprobs[i]) == {texts[i], *(tokenizer.decode([t]) for t in ids.tolist())}
        for token_id, value in zip(ids.tolist(), values.tolist(), strict=True):
            assert lp.top_logprobs[i][tokenizer.decode([token_id])] == pytest.approx(value, abs=ATOL)


def test_echo_with_logprobs_covers_the_prompt_then_the_completion(client, demo_llm, hf_model):
    prompt = demo_llm.tokenizer(PROMPT)["input_ids"]
    plain = client.completions.create(model="demo", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=TOP)
    echoed = client.completions.create(model="demo", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=TOP,
                                       echo=True)
    choice = echoed.choices[0]
    assert choice.text == PROMPT + plain.choices[0].text
    lp, n = choice.logprobs, len(prompt)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n + 4
    assert_prompt_part(lp, prompt, demo_llm.tokenizer, hf_model)
    # The completion's part is the plain request's, its offsets after the echoed prompt.
    completion = plain.choices[0].logprobs
    assert lp.tokens[n:] == completion.tokens
    assert lp.token_logprobs[n:] == pytest.approx(completion.token_logprobs, abs=1e-6)
    assert lp.text_offset[n:] == [len(PROMPT) + offset for offset in completion.text_offset]
    assert echoed.usage.prompt_tokens == n and echoed.usage.completion_tokens == 4


def test_streamed_echo_logprobs_equal_the_whole_answer(client):
    whole = client.completions.create(model="demo", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=1,
                                      echo=True)
    chunks = list(client.completions.create(model="demo", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=1,
                                            echo=True, stream=True))
    assert chunks[0].choices[0].text == PROMPT  # the echo comes first, with the prompt's logprobs
    joined = {key: [] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    for chunk in chunks:
        for key in joined:
            joined[key].extend(getattr(chunk.choices[0].logprobs, key))
    expected = whole.choices[0].logprobs
    assert joined["tokens"] == expected.tokens and joined["text_offset"] == expected.text_offset
    assert joined["token_logprobs"][0] is None
    assert joined["token_logprobs"][1:] == pytest.approx(expected.token_logprobs[1:], abs=1e-6)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text


def test_echo_logprobs_for_token_prompts_several_prompts_and_n(client, demo_llm, hf_model):
    first = demo_llm.tokenizer(PROMPT)["input_ids"]
    second = demo_llm.tokenizer("The fox jumps")["input_ids"]
    result = client.completions.create(model="demo", prompt=[first, second], n=2, max_tokens=3, logprobs=0,
                                       echo=True, seed=3)
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    for choice in result.choices:
        prompt = first if choice.index < 2 else second
        assert_prompt_part(choice.logprobs, prompt, demo_llm.tokenizer, hf_model, top=0)
        assert len(choice.logprobs.tokens) == len(prompt) + 3


def test_echo_logprobs_with_beam_search_is_400(client, server):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="demo", prompt=PROMPT, n=2, max_tokens=3, logprobs=1, echo=True,
                                  extra_body={"use_beam_search": True})
    assert info.value.body["param"] == "echo"
    assert server.client.get("/health").json() == {"status": "healthy"}
    assert client.completions.create(model="demo", prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2
