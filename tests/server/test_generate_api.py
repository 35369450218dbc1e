"""KsanaLLM's native /generate through raw httpx: NUL-delimited cumulative chunks, its sampling_config keys."""

from __future__ import annotations

import orjson

from ksana import SamplingParams

PROMPT = "The capital of France is"
KEYS = {"texts", "output_token_ids", "logprobs", "input_token_ids"}


def _chunks(server, body: dict) -> list[dict]:
    with server.client.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200
        raw = b"".join(response.iter_bytes())
    parts = raw.split(b"\0")
    assert parts[-1] == b"", "every chunk ends with a NUL byte"
    return [orjson.loads(part) for part in parts[:-1]]


def test_streamed_chunks_are_cumulative_and_nul_delimited(server, demo_llm):
    reference = demo_llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0]
    chunks = _chunks(server, {"prompt": PROMPT, "sampling_config": {"max_new_tokens": 8}})  # stream defaults to true
    assert len(chunks) > 1, "streamed as the tokens come"
    counts = [len(chunk["output_token_ids"][0]) for chunk in chunks]
    assert counts == sorted(set(counts)) and counts[-1] == 8, "a chunk only when the token count grows"
    for chunk in chunks:
        assert set(chunk) == KEYS
        assert chunk["input_token_ids"] == reference.prompt_token_ids
        tokens = chunk["output_token_ids"][0]
        assert tokens == reference.outputs[0].token_ids[: len(tokens)]
        assert reference.outputs[0].text.startswith(chunk["texts"][0])
    assert chunks[-1]["texts"] == [reference.outputs[0].text]
    assert chunks[-1]["logprobs"] is None


def test_non_stream_input_tokens_parallel_samples_and_logprobs(server, demo_llm):
    ids = demo_llm.tokenizer(PROMPT)["input_ids"]
    params = SamplingParams(n=2, temperature=0.8, top_k=50, seed=3, max_tokens=6, logprobs=2)
    reference = demo_llm.generate([ids], params, use_tqdm=False)[0]
    body = {"input_tokens": ids, "stream": False, "sampling_config": {
        "do_sample": True, "temperature": 0.8, "topk": 50, "seed": 3, "max_new_tokens": 6,
        "num_return_sequences": 2, "logprobs": 2}}
    result = server.client.post("/generate", json=body).json()
    assert result["output_token_ids"] == [o.token_ids for o in reference.outputs]
    assert result["texts"] == [o.text for o in reference.outputs]
    for sequence, output in zip(result["logprobs"], reference.outputs, strict=True):
        assert len(sequence) == 6
        for (chosen, *top), token_id, logprob in zip(sequence, output.token_ids, output.token_logprobs, strict=True):
            assert chosen[0] == token_id and abs(chosen[1] - logprob) < 1e-5
            assert len(top) == 2 and top[0][1] >= top[1][1]


def test_greedy_rules_and_stop_strings(server):
    greedy = server.client.post("/generate", json={"prompt": PROMPT, "stream": False,
                                                   "sampling_config": {"max_new_tokens": 10}}).json()
    # temperature alone does not sample: KsanaLLM's topk defaults to 1.
    warm = server.client.post("/generate", json={"prompt": PROMPT, "stream": False, "sampling_config": {
        "max_new_tokens": 10, "temperature": 1.5, "seed": 1}}).json()
    assert warm["output_token_ids"] == greedy["output_token_ids"]
    text = greedy["texts"][0]
    stop = text[3:6]
    stopped = server.client.post("/generate", json={"prompt": PROMPT, "stream": False, "sampling_config": {
        "max_new_tokens": 10, "stop_strings": [stop]}}).json()
    assert stopped["texts"] == [text[: text.index(stop)]]


def test_bad_generate_requests(server):
    cases = [
        {"sampling_config": {"max_new_tokens": 3}},  # no prompt
        {"prompt": ""},
        {"prompt": PROMPT, "sampling_config": {"topk": 0}},
        {"prompt": PROMPT, "sampling_config": {"max_new_tokens": "3"}},
        {"prompt": PROMPT, "sampling_config": {"num_beams": 2, "num_return_sequences": 3}},
        {"input_tokens": [1, 2, 10**6]},
    ]
    for body in cases:
        response = server.client.post("/generate", json=body)
        assert response.status_code == 400, body
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert server.client.post("/generate", content=b"[1, 2").status_code == 400
    ok = server.client.post("/generate", json={"prompt": PROMPT, "stream": False,
                                               "sampling_config": {"max_new_tokens": 2}})
    assert ok.status_code == 200 and len(ok.json()["output_token_ids"][0]) == 2
