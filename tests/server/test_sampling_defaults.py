"""``--generation-config``: a request that leaves sampling fields out gets the model's generation_config.json values
(``auto``, the default), or the API's neutral ones (``vllm``); what a request sets always wins."""

from __future__ import annotations

import json

import openai
import pytest

from ksana import SamplingParams
from ksana.builtin import demo_model_dir
from ksana.generation_config import read_sampling_defaults
from tests.server.conftest import ServerProcess

PROMPT = "Once upon a time there was"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
# Greedy with a repetition penalty, 5 tokens: different enough from temperature 1 and 16 tokens to tell apart.
GENERATION_CONFIG = {"do_sample": False, "eos_token_id": 2, "temperature": 0.0, "repetition_penalty": 1.3,
                     "max_new_tokens": 5}
MODEL_DEFAULTS = dict(temperature=0.0, repetition_penalty=1.3)


def _model_dir(root):
    """The demo model with its own sampling defaults in generation_config.json."""
    model_dir = root / "demo-with-defaults"
    model_dir.mkdir()
    for path in demo_model_dir().iterdir():
        if path.name != "generation_config.json":
            (model_dir / path.name).symlink_to(path)
    (model_dir / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return model_dir


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """One server reading the model's defaults (``auto``) and one ignoring them (``vllm``), started together."""
    model_dir = _model_dir(tmp_path_factory.mktemp("generation-config"))
    processes = {source: ServerProcess("--model", str(model_dir), "--served-model-name", "demo", "--dtype", "float32",
                                       "--generation-config", source) for source in ("auto", "vllm")}
    try:
        yield {source: process.wait_ready() for source, process in processes.items()}
    finally:
        for process in processes.values():
            process.close()


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _offline_chat(demo_llm, **params):
    return demo_llm.chat(MESSAGES, SamplingParams(**params), use_tqdm=False)[0].outputs[0]


def test_left_out_fields_take_the_models_defaults(servers, demo_llm):
    server = servers["auto"]
    assert "temperature=0.0, repetition_penalty=1.3, max_tokens=5" in server.logs()
    with _client(server) as client:
        chat = client.chat.completions.create(model="demo", messages=MESSAGES)
        expected = _offline_chat(demo_llm, max_tokens=5, **MODEL_DEFAULTS)
        assert chat.choices[0].message.content == expected.text
        assert chat.usage.completion_tokens == len(expected.token_ids) <= 5
        # Completions keep OpenAI's 16 where the model's default is higher; here it is lower.
        completion = client.completions.create(model="demo", prompt=PROMPT, extra_body={"ignore_eos": True})
        assert completion.usage.completion_tokens == 5


def test_what_a_request_sets_wins_over_the_models_defaults(servers, demo_llm):
    with _client(servers["auto"]) as client:
        sampled = client.chat.completions.create(model="demo", messages=MESSAGES, temperature=1.0, seed=11,
                                                 max_tokens=7, extra_body={"repetition_penalty": 1.0,
                                                                           "ignore_eos": True})
    expected = _offline_chat(demo_llm, temperature=1.0, seed=11, max_tokens=7, ignore_eos=True)
    assert sampled.choices[0].message.content == expected.text
    assert sampled.usage.completion_tokens == 7


def test_generation_config_vllm_ignores_the_models_defaults(servers, demo_llm):
    server = servers["vllm"]
    assert "sampling defaults from the model" not in server.logs()
    with _client(server) as client:
        chat = client.chat.completions.create(model="demo", messages=MESSAGES, seed=5, max_tokens=8,
                                              extra_body={"ignore_eos": True})
        completion = client.completions.create(model="demo", prompt=PROMPT, extra_body={"ignore_eos": True})
    # The neutral defaults: temperature 1, no penalty; completions' 16 tokens.
    expected = _offline_chat(demo_llm, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    assert chat.choices[0].message.content == expected.text
    assert completion.usage.completion_tokens == 16


def test_read_sampling_defaults(tmp_path):
    model_dir = _model_dir(tmp_path)
    assert read_sampling_defaults(model_dir) == {"temperature": 0.0, "repetition_penalty": 1.3, "max_tokens": 5}
    assert read_sampling_defaults(model_dir, "vllm") == {}
    assert read_sampling_defaults(demo_model_dir()) == {}  # do_sample alone is no sampling default (as in vLLM)
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_p": 0.5, "top_k": 20, "min_p": 0.1}))
    assert read_sampling_defaults(model_dir, str(other)) == {"top_p": 0.5, "top_k": 20, "min_p": 0.1}
    with pytest.raises(FileNotFoundError, match="generation_config.json"):
        read_sampling_defaults(model_dir, str(tmp_path / "missing"))
    (other / "generation_config.json").write_text(json.dumps({"top_p": 0.0}))
    with pytest.raises(ValueError, match="top_p"):
        read_sampling_defaults(model_dir, str(other))
