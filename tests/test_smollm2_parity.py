"""The real model: Ksana's greedy SmolLM2-135M-Instruct output is ``transformers``' greedy output and knows Paris."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from ksana import LLM, SamplingParams
from ksana.builtin import smollm2_model_dir

PROMPTS = [
    "The three primary colors are",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    # Longer than a CPU prefill's query chunk (kernels.attention.PREFILL_QUERY_CHUNK), two chunks and a part.
    "The history of the printing press begins long before Gutenberg. In China, woodblock printing was used to "
    "reproduce texts and images on paper and cloth by the ninth century, and movable type made of baked clay "
    "was described by the scholar Shen Kuo in the eleventh century. Korean printers later cast movable type in "
    "bronze, and the oldest surviving book printed that way dates from 1377. In Europe, Johannes Gutenberg of "
    "Mainz combined a hand mould for casting metal type, an oil-based ink and a screw press adapted from the "
    "ones used to make wine. His Bible, finished around 1455, showed that printed books could be as beautiful "
    "as manuscripts. Within fifty years, presses were running in more than two hundred European cities, and "
    "the price of books fell sharply. The most important consequence of the printing press was",
]


def test_smollm2_greedy_matches_transformers_and_answers_paris():
    """Greedy decoding picks, at each step, the argmax after the tokens before it. One ``transformers`` forward over
    the prompt and Ksana's tokens gives that argmax at every position: Ksana's tokens equal them exactly when
    ``transformers``' greedy ``generate`` would produce the same tokens, for one forward per prompt, not per token."""
    llm = LLM(model="smollm2", max_batch_size=8)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    results = llm.generate(PROMPTS, params, use_tqdm=False)

    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_model_dir(progress=False)), dtype=torch.float32).eval()
    eos = hf.generation_config.eos_token_id
    eos_ids = set(eos) if isinstance(eos, list) else {eos}
    for result in results:
        completion = result.outputs[0]
        num_prompt = len(result.prompt_token_ids)
        sequence = result.prompt_token_ids + completion.token_ids
        with torch.inference_mode():
            logits = hf(torch.tensor([sequence[:-1]])).logits[0, num_prompt - 1:]
        assert logits.argmax(dim=-1).tolist() == completion.token_ids, result.prompt
        # Where transformers' generate stops: at the first end-of-sequence token, else after max_tokens.
        assert not eos_ids & set(completion.token_ids[:-1]), result.prompt
        assert completion.token_ids[-1] in eos_ids or len(completion.token_ids) == params.max_tokens, result.prompt

    answer = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)[0].outputs[0]
    assert "Paris" in answer.text, answer.text
    assert answer.finish_reason == "stop"  # ended on <|im_end|>, which the text does not show
    assert "<|im_end|>" not in answer.text


def test_smollm2_bfloat16_prefill_logprobs_match_transformers():
    """bfloat16 (where AMX CPUs run a prompt's projections through oneDNN): each prompt's first token and its
    top logprobs as ``transformers`` in bfloat16 gives them, the long prompt's included. bfloat16 keeps 8 bits of
    mantissa, so logits near 20 round in steps of 0.125: the tolerance of 0.25 allows a step either way, while a
    broken kernel is off by more than 20."""
    llm = LLM(model="smollm2", dtype="bfloat16", max_batch_size=8)
    results = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=1, logprobs=4), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_model_dir(progress=False)), dtype=torch.bfloat16).eval()
    for result in results:
        with torch.inference_mode():
            logits = hf(torch.tensor([result.prompt_token_ids]), logits_to_keep=1).logits[0, -1].float()
        expected = torch.log_softmax(logits, -1)
        top2 = expected.topk(2).values
        chosen = result.outputs[0].token_ids[0]
        assert chosen == int(expected.argmax()) or top2[0] - top2[1] < 0.1, result.prompt
        ours = result.outputs[0].logprobs[0]
        assert len(ours) >= 4
        for token_id, logprob in ours.items():
            assert abs(logprob - float(expected[token_id])) < 0.25, (result.prompt, token_id)  # broken: > 20
