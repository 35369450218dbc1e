"""64 concurrent streaming clients: each stream's tokens equal the offline greedy result for its prompt.

The clients start together, so the server batches them in compositions the offline run never sees (arrivals spread
over several steps, requests joining mid-way); a result that depended on the batch would show here.
"""

from __future__ import annotations

import random

import openai
import trio

from ksana import SamplingParams
from ksana.builtin.demo import CORPUS

NUM_CLIENTS = 64


def _workload():
    rng = random.Random(0)
    words = CORPUS.split()
    prompts, max_tokens = [], []
    for _ in range(NUM_CLIENTS):
        start = rng.randrange(len(words) - 40)
        prompts.append(" ".join(words[start: start + rng.randint(1, 40)]))
        max_tokens.append(rng.randint(4, 32))
    return prompts, max_tokens


def test_64_concurrent_streams_equal_offline_greedy(server, demo_llm):
    prompts, max_tokens = _workload()
    reference = demo_llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n) for n in max_tokens],
                                  use_tqdm=False)
    streamed: dict[int, list[int]] = {}
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}

    async def one_client(client: openai.AsyncOpenAI, i: int) -> None:
        stream = await client.completions.create(
            model="demo", prompt=prompts[i], max_tokens=max_tokens[i], temperature=0, stream=True, logprobs=0,
            extra_body={"return_tokens_as_token_ids": True})
        tokens, text = [], ""
        async for chunk in stream:
            choice = chunk.choices[0]
            text += choice.text
            if choice.logprobs is not None:
                tokens.extend(int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens)
            if choice.finish_reason is not None:
                finish[i] = choice.finish_reason
        streamed[i], texts[i] = tokens, text

    async def main() -> None:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=120) as client:
            async with trio.open_nursery() as nursery:
                for i in range(NUM_CLIENTS):
                    nursery.start_soon(one_client, client, i)

    trio.run(main)
    for i, result in enumerate(reference):
        expected = result.outputs[0]
        assert streamed[i] == expected.token_ids, f"client {i}: prompt {prompts[i]!r}"
        assert texts[i] == expected.text
        assert finish[i] == expected.finish_reason
    # Every request finished and gave its blocks back.
    values = server.wait_metrics(lambda m: m["block_manager_used_block_num"] == 0)
    assert values["block_manager_request_num"] == 0
