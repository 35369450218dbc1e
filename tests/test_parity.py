"""Token-for-token parity with Hugging Face ``transformers`` ``generate`` through the whole engine.

Random-weight Llama, Qwen2 (plain, and mixed sliding/full layers with a window shorter than the longest prompt)
and Mistral checkpoints in safetensors; a batch of 8 prompts of 5 to 300 tokens, greedy, 32 new tokens. Then again
with chunked prefill, and with a KV pool so small that requests are preempted and recomputed. Every checkpoint
format loads through the same ``load_model``, whose logits tests/models/test_model_parity.py checks per format.
"""

from __future__ import annotations

import pytest
import torch

from ksana import LLM, SamplingParams
from tests.model_factory import load_hf_model, make_checkpoint, random_prompts

PROMPT_LENGTHS = [5, 17, 32, 64, 100, 150, 211, 300]
NUM_NEW = 32
FAMILIES = ["llama", "qwen2", "qwen2-mixed-swa", "mistral"]
# min_tokens bans EOS exactly as HF's min_new_tokens does, so both run the full 32 tokens.
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, min_tokens=NUM_NEW, logprobs=0)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity")
    return {family: make_checkpoint(root / family, family) for family in FAMILIES}


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(PROMPT_LENGTHS, seed=11)


@pytest.fixture(scope="module")
def hf_reference(checkpoints, prompts):
    """HF greedy tokens and the chosen tokens' logprobs (from its raw output logits), per family."""
    reference = {}
    for family in FAMILIES:
        model = load_hf_model(checkpoints[family], torch.float32)
        per_prompt = []
        for prompt in prompts:
            with torch.inference_mode():
                out = model.generate(torch.tensor([prompt]), max_new_tokens=NUM_NEW, min_new_tokens=NUM_NEW,
                                     do_sample=False, output_logits=True, return_dict_in_generate=True)
            tokens = out.sequences[0, len(prompt):].tolist()
            logprobs = [torch.log_softmax(step[0].float(), -1)[tok].item() for step, tok in zip(out.logits, tokens, strict=True)]
            per_prompt.append((tokens, logprobs))
        reference[family] = per_prompt
    return reference


def _generate(path, prompts, **overrides):
    llm = LLM(model=str(path), dtype="float32", block_token_num=16, **overrides)
    return llm, llm.generate(prompts, GREEDY, use_tqdm=False)


def _assert_matches(results, reference, check_logprobs=True):
    for i, (result, (tokens, logprobs)) in enumerate(zip(results, reference, strict=True)):
        completion = result.outputs[0]
        assert completion.token_ids == tokens, f"prompt {i} ({len(result.prompt_token_ids)} tokens)"
        assert completion.finish_reason == "length"
        if check_logprobs:
            assert completion.token_logprobs == pytest.approx(logprobs, abs=1e-4), f"prompt {i}"


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_and_logprobs_match_transformers(family, checkpoints, prompts, hf_reference):
    llm, results = _generate(checkpoints[family], prompts)
    _assert_matches(results, hf_reference[family])
    assert [r.prompt_token_ids for r in results] == prompts
    assert llm.engine.cache_manager.num_free_blocks == llm.engine.num_blocks


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_matches_transformers(family, checkpoints, prompts, hf_reference):
    llm, results = _generate(checkpoints[family], prompts, split_fuse_token_num=24,
                             max_step_tokens=64)
    _assert_matches(results, hf_reference[family])
    assert llm.engine.scheduler.stats.num_steps > NUM_NEW + sum(PROMPT_LENGTHS) // 64


@pytest.mark.parametrize("family", FAMILIES)
def test_preemption_recomputes_to_the_same_tokens(family, checkpoints, prompts, hf_reference):
    # 24 blocks of 16 tokens: the longest request (332 tokens) fits alone, the batch does not.
    llm, results = _generate(checkpoints[family], prompts, num_device_blocks=24)
    assert llm.engine.scheduler.stats.num_preemptions > 0
    _assert_matches(results, hf_reference[family])
    assert llm.engine.cache_manager.num_free_blocks == 24
