"""Speculative decoding with prompt lookup through the whole engine: lossless, and it pays where text repeats.

Greedy output with speculation equals ``transformers``' greedy output (tokens and logprobs), also with chunked
prefill, preemption and parallel samples; seeded sampling gives the same tokens as without speculation, and the
sampled tokens follow the model's distribution; on self-repeating prompts most drafts are accepted and the engine
takes fewer steps; no KV block stays taken.
"""

from __future__ import annotations

import collections
import itertools
import random

import pytest
import torch

from ksana import LLM, SamplingParams
from ksana.config import ConfigError
from tests.model_factory import hf_greedy_generate, load_hf_model, make_checkpoint

NUM_NEW = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, min_tokens=NUM_NEW, logprobs=0)
SPEC = dict(ngram_step_num=3, prompt_lookup_min=1, prompt_lookup_max=3, spec_max_batch_size=0)


def repeating_prompts(seed: int = 5) -> list[list[int]]:
    """Prompts that quote themselves (so prompt lookup always finds something to draft), of mixed lengths."""
    rng = random.Random(seed)
    prompts = []
    for period, repeats, tail in [(4, 3, 1), (7, 4, 3), (12, 3, 5), (5, 12, 2), (30, 4, 9), (3, 2, 0)]:
        block = [rng.randrange(500) for _ in range(period)]
        prompts.append(block * repeats + block[:tail])
    return prompts


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    return {family: make_checkpoint(root / family, family) for family in ("llama", "qwen2-mixed-swa")}


def _run(path, prompts, params=GREEDY, **overrides):
    llm = LLM(model=str(path), dtype="float32", block_token_num=16, **overrides)
    results = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.cache_manager.num_free_blocks == llm.engine.num_blocks
    return llm, results


@pytest.mark.parametrize("family", ["llama", "qwen2-mixed-swa"])
def test_greedy_with_prompt_lookup_matches_transformers(family, checkpoints):
    prompts = repeating_prompts()
    plain, plain_results = _run(checkpoints[family], prompts)
    llm, results = _run(checkpoints[family], prompts, **SPEC)
    hf = load_hf_model(checkpoints[family])
    for prompt, result, plain_result in zip(prompts, results, plain_results, strict=True):
        completion = result.outputs[0]
        assert completion.token_ids == hf_greedy_generate(hf, prompt, NUM_NEW)
        assert completion.token_logprobs == pytest.approx(plain_result.outputs[0].token_logprobs, abs=1e-4)
    stats = llm.spec_decoding_stats
    assert stats.spec_draft_token_num > 0 and stats.spec_draft_hit_num > 0  # both verdicts were exercised
    assert stats.spec_draft_hit_num < stats.spec_draft_token_num
    assert plain.spec_decoding_stats.num_verify_rows == 0


def test_chunked_prefill_preemption_and_parallel_samples_stay_lossless(checkpoints):
    prompts = repeating_prompts(seed=9) * 2
    params = SamplingParams(temperature=0.0, max_tokens=40, min_tokens=40, n=2)
    tight = dict(split_fuse_token_num=32, max_step_tokens=48, num_device_blocks=14)
    plain, plain_results = _run(checkpoints["llama"], prompts, params, **tight)
    llm, results = _run(checkpoints["llama"], prompts, params, **tight, **SPEC)
    assert llm.engine.scheduler.stats.num_preemptions > 0
    assert llm.spec_decoding_stats.spec_draft_hit_num > 0
    for result, plain_result in zip(results, plain_results, strict=True):
        assert [c.token_ids for c in result.outputs] == [c.token_ids for c in plain_result.outputs]


def test_seeded_sampling_gives_the_tokens_it_gives_without_speculation(checkpoints):
    prompts = repeating_prompts(seed=3)
    params = [SamplingParams(temperature=0.8, top_k=20, max_tokens=NUM_NEW, seed=100 + i,
                             repetition_penalty=1.1 if i % 2 else 1.0) for i in range(len(prompts))]
    _, plain_results = _run(checkpoints["llama"], prompts, params)
    llm, results = _run(checkpoints["llama"], prompts, params, **SPEC)
    assert llm.spec_decoding_stats.spec_draft_token_num > 0
    for result, plain_result in zip(results, plain_results, strict=True):
        assert result.outputs[0].token_ids == plain_result.outputs[0].token_ids


def test_sampled_tokens_follow_the_model_distribution(tmp_path):
    """Vocabulary of 8: the second and third tokens' joint frequencies over 3,000 samples against the exact
    probabilities from ``transformers``. The third token is sampled at a draft's position, so a rule that kept
    drafts it should reject (or resampled wrongly) moves these frequencies far past the bound."""
    vocab = 8
    path = make_checkpoint(tmp_path, "llama", vocab_size=vocab, eos_token_id=vocab - 1)
    prompt = [5, 1, 2, 6, 3, 0, 7, 4, 5, 1, 2, 6]  # every token occurs: prompt lookup drafts after any first token
    num_samples = 3000
    params = [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=i) for i in range(num_samples)]
    llm, results = _run(path, [prompt] * num_samples, params, max_batch_size=256, max_waiting_queue_len=num_samples, **SPEC)
    assert llm.spec_decoding_stats.num_verify_rows == num_samples
    counts = collections.Counter(tuple(r.outputs[0].token_ids[1:]) for r in results)

    hf = load_hf_model(path)
    with torch.inference_mode():
        def probs(tokens):
            return torch.softmax(hf(input_ids=torch.tensor([tokens])).logits[0, -1].double(), -1)
        first = probs(prompt)
        exact = collections.Counter()
        for t1 in range(vocab):
            second = probs(prompt + [t1])
            for t2 in range(vocab):
                third = probs(prompt + [t1, t2])
                for t3 in range(vocab):
                    exact[(t2, t3)] += float(first[t1] * second[t2] * third[t3])
    total_variation = 0.5 * sum(abs(counts[pair] / num_samples - exact[pair])
                                for pair in itertools.product(range(vocab), repeat=2))
    # Sampling noise alone gives about 0.05 here; emitting the drafts instead of the samples gives about 0.5.
    assert total_variation < 0.08


@pytest.mark.parametrize("overrides, key", [
    (dict(ngram_step_num=2, mtp_step_num=1), "ngram_step_num"),
    (dict(ngram_step_num=-1), "ngram_step_num"),
    (dict(ngram_step_num=2, prompt_lookup_min=3, prompt_lookup_max=2), "prompt_lookup_max"),
    (dict(prompt_lookup_min=0), "prompt_lookup_min"),
])
def test_bad_speculation_settings_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key):
        LLM(model="demo", **overrides)


def test_no_drafts_while_more_requests_run_than_spec_max_batch_size(checkpoints):
    prompts = repeating_prompts()[:4] * 2  # 8 requests that run to the same length side by side
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    capped, capped_results = _run(checkpoints["llama"], prompts, params, **{**SPEC, "spec_max_batch_size": 4})
    drafting, results = _run(checkpoints["llama"], prompts, params, **{**SPEC, "spec_max_batch_size": 8})
    assert capped.spec_decoding_stats.num_verify_rows == 0
    assert drafting.spec_decoding_stats.num_verify_rows > 0
    assert [r.outputs[0].token_ids for r in capped_results] == [r.outputs[0].token_ids for r in results]
