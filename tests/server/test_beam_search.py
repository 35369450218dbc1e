"""Beam search equals ``transformers`` ``generate(num_beams=4, do_sample=False)``: sequences and their scores.

In process, the search itself is driven by the Hugging Face model's own log-probabilities across length penalties,
``early_stopping`` modes, several EOS ids and ``min_tokens`` (exact same numbers, so any bookkeeping difference
shows). Through the server, the demo model's beams and scores from ``/generate`` equal HF's on the same checkpoint.
"""

from __future__ import annotations

import pytest
import torch
import trio

from ksana.builtin import resolve_model_dir
from ksana.server.beam_search import BeamSearchParams, beam_search
from tests.model_factory import EOS_TOKEN_ID, load_hf_model, make_hf_model, random_prompts

NUM_BEAMS = 4


@torch.inference_mode()
def hf_beam_search(model, prompt: list[int], max_new_tokens: int, eos: list[int], **kwargs):
    """HF's beams (generated tokens only) and scores, best first."""
    out = model.generate(torch.tensor([prompt]), num_beams=NUM_BEAMS, num_return_sequences=NUM_BEAMS,
                         do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=eos[0],
                         return_dict_in_generate=True, output_scores=True, **kwargs)
    sequences = []
    for row in out.sequences.tolist():
        generated = row[len(prompt):]
        for i, token in enumerate(generated):  # cut the padding after the first EOS
            if token in eos:
                generated = generated[: i + 1]
                break
        sequences.append(generated)
    return sequences, out.sequences_scores.tolist()


def hf_expand(model, prompt: list[int]):
    @torch.inference_mode()
    async def expand(beams, num_top):
        tops = []
        for beam in beams:
            logits = model(torch.tensor([prompt + list(beam)])).logits[0, -1].float()
            values, ids = torch.log_softmax(logits, dim=-1).topk(num_top)
            tops.append(list(zip(ids.tolist(), values.tolist(), strict=True)))
        return tops

    return expand


@pytest.fixture(scope="module")
def tiny_model():
    return make_hf_model("llama", seed=3)


# (length_penalty, early_stopping, how many of the likeliest first tokens are extra EOS ids, min_tokens, whether the
# search should end before max_tokens): plain beams; HF's early-stop heuristic at the current length, at max_length
# ("never"), and early_stopping=True; a negative length penalty; finished beams mixed with running ones; min_tokens.
CASES = [
    (1.0, False, 0, 0, False),
    (0.0, False, 6, 0, True),
    (1.0, True, 6, 0, True),
    (0.5, "never", 6, 0, True),
    (-0.5, False, 3, 0, False),
    (0.0, True, 3, 0, False),
    (2.0, False, 5, 0, False),
    (0.0, False, 10, 2, False),
]


@pytest.mark.parametrize(("length_penalty", "early_stopping", "num_extra_eos", "min_tokens", "ends_early"), CASES)
def test_beam_search_bookkeeping_equals_transformers(tiny_model, length_penalty, early_stopping, num_extra_eos,
                                                     min_tokens, ends_early):
    prompt = random_prompts([7], seed=1)[0]
    max_new_tokens = 8
    with torch.inference_mode():
        first = torch.log_softmax(tiny_model(torch.tensor([prompt])).logits[0, -1], dim=-1)
    # The likeliest first tokens but the very best one, so some beams end at once and others go on.
    eos = [EOS_TOKEN_ID] + first.topk(num_extra_eos + 1).indices.tolist()[1:]
    kwargs = {"length_penalty": length_penalty, "early_stopping": early_stopping}
    if min_tokens:
        kwargs["min_new_tokens"] = min_tokens
    expected, expected_scores = hf_beam_search(tiny_model, prompt, max_new_tokens, eos, **kwargs)

    params = BeamSearchParams(beam_width=NUM_BEAMS, max_tokens=max_new_tokens, eos_token_ids=frozenset(eos),
                              length_penalty=length_penalty, early_stopping=early_stopping, min_tokens=min_tokens)
    num_steps = 0
    expand = hf_expand(tiny_model, prompt)

    async def counting_expand(beams, num_top):
        nonlocal num_steps
        num_steps += 1
        return await expand(beams, num_top)

    hypotheses = trio.run(beam_search, params, counting_expand)
    assert [list(h.token_ids) for h in hypotheses] == expected
    assert [h.score for h in hypotheses] == pytest.approx(expected_scores, rel=1e-6, abs=1e-5)
    assert (num_steps < max_new_tokens) == ends_early
    assert [h.finish_reason for h in hypotheses] == ["stop" if h.token_ids[-1] in eos else "length"
                                                     for h in hypotheses]


def test_server_beam_search_equals_transformers_on_the_demo_model(server):
    hf = load_hf_model(resolve_model_dir("demo"))
    prompt = server.client.post("/tokenize", json={"prompt": "Once upon a time"}).json()["tokens"]
    for extra in ({}, {"length_penalty": 2.0}):
        body = {"input_tokens": prompt, "stream": False, "sampling_config": {
            "num_beams": NUM_BEAMS, "num_return_sequences": NUM_BEAMS, "max_new_tokens": 8} | extra}
        result = server.client.post("/generate", json=body).json()
        expected, scores = hf_beam_search(hf, prompt, 8, [2], **extra)
        assert result["output_token_ids"][0] == expected[0]
        assert result["scores"][0] == pytest.approx(scores[0], abs=1e-4)
        assert result["output_token_ids"] == expected
        assert result["scores"] == pytest.approx(scores, abs=1e-4)
    # A stop token the beams meet: finished hypotheses compete with running ones, as HF's extra EOS id.
    stop = expected[0][2]
    body = {"input_tokens": prompt, "stream": False, "sampling_config": {
        "num_beams": NUM_BEAMS, "num_return_sequences": 2, "max_new_tokens": 8, "stop_token_ids": [stop]}}
    result = server.client.post("/generate", json=body).json()
    expected, scores = hf_beam_search(hf, prompt, 8, [2, stop])
    assert result["output_token_ids"] == expected[:2]
    assert result["scores"] == pytest.approx(scores[:2], abs=1e-4)
