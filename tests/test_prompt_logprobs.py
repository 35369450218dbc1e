"""``SamplingParams(prompt_logprobs=k)``: every prompt token's logprob, rank and top-k equal ``transformers``'
log-softmax of its logits, whether the prompt runs whole, in chunks, beside other requests, after a prefix-cache
hit would have been possible, or again after a preemption."""

from __future__ import annotations

import pytest
import torch

from ksana import LLM, SamplingParams
from ksana.outputs import Logprob
from tests.model_factory import load_hf_model, make_checkpoint, random_prompts

TOP = 3
ATOL = 1e-4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("prompt-logprobs")
    return {family: make_checkpoint(root / family, family) for family in ("llama", "qwen2-mixed-swa")}


@pytest.fixture(scope="module")
def hf_models(checkpoints):
    return {family: load_hf_model(path, torch.float32) for family, path in checkpoints.items()}


def hf_logprobs(hf_model, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), dim=-1)


def assert_matches_transformers(result, hf_model, top: int = TOP) -> None:
    prompt = result.prompt_token_ids
    got = result.prompt_logprobs
    assert got is not None and len(got) == len(prompt) and got[0] is None
    reference = hf_logprobs(hf_model, prompt)
    for i in range(1, len(prompt)):
        entry, expected = got[i], reference[i - 1]
        token = prompt[i]
        assert next(iter(entry)) == token  # the prompt's own token first
        assert all(isinstance(v, Logprob) for v in entry.values())
        want = expected[token].item()
        assert entry[token].logprob == pytest.approx(want, abs=ATOL)
        # Its rank: 1 + the tokens more likely, up to the tolerance of the values.
        assert (expected > want + ATOL).sum().item() + 1 <= entry[token].rank <= (expected > want - ATOL).sum().item() + 1
        values, ids = expected.topk(top)
        assert set(entry) == {token, *ids.tolist()}  # the top-k ids exactly, and the prompt's token
        for rank, (tid, value) in enumerate(zip(ids.tolist(), values.tolist(), strict=True), start=1):
            assert entry[tid].logprob == pytest.approx(value, abs=ATOL)
            if tid != token:
                assert entry[tid].rank == rank


@pytest.mark.parametrize("family", ["llama", "qwen2-mixed-swa"])
@pytest.mark.parametrize("split_fuse_token_num", [0, 7])
def test_prompt_logprobs_match_transformers(family, split_fuse_token_num, checkpoints, hf_models):
    """Prompts of several lengths in one batch (one of a single token), whole or cut into 7-token chunks that
    share steps with other requests' chunks and decodes."""
    llm = LLM(model=str(checkpoints[family]), dtype="float32", split_fuse_token_num=split_fuse_token_num,
              max_step_tokens=64)
    prompts = random_prompts([40, 9, 1, 23], seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=TOP)
    results = llm.generate(prompts, params, use_tqdm=False)
    for result in results:
        assert_matches_transformers(result, hf_models[family])
    assert results[2].prompt_logprobs == [None]
    # The generated tokens are the same as without prompt logprobs.
    plain = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert [r.outputs[0].token_ids for r in results] == [r.outputs[0].token_ids for r in plain]
    assert all(r.prompt_logprobs is None for r in plain)


def test_prompt_logprobs_zero_gives_the_prompt_tokens_only(checkpoints, hf_models):
    llm = LLM(model=str(checkpoints["llama"]), dtype="float32")
    result = llm.generate(random_prompts([12], seed=8), SamplingParams(max_tokens=1, prompt_logprobs=0),
                          use_tqdm=False)[0]
    assert [list(entry) for entry in result.prompt_logprobs[1:]] == [[t] for t in result.prompt_token_ids[1:]]
    assert_matches_transformers(result, hf_models["llama"], top=0)


def test_prompt_logprobs_skip_prefix_cache_hits(checkpoints, hf_models):
    """A request for prompt logprobs computes its whole prompt though the cache holds its prefix; the cache still
    serves the requests that do not ask."""
    llm = LLM(model=str(checkpoints["llama"]), dtype="float32", enable_auto_prefix_cache=True, block_token_num=16,
              split_fuse_token_num=16)
    prefix, tail_a, tail_b = random_prompts([48, 5, 7], seed=6)
    warm = llm.generate([prefix + tail_a], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)[0]
    assert warm.num_cached_tokens == 0
    asked = llm.generate([prefix + tail_b], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=TOP),
                         use_tqdm=False)[0]
    assert asked.num_cached_tokens == 0
    assert_matches_transformers(asked, hf_models["llama"])
    hit = llm.generate([prefix + tail_b], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)[0]
    assert hit.num_cached_tokens == 48
    assert hit.outputs[0].token_ids == asked.outputs[0].token_ids
    llm.engine.cache_manager.check_invariants()


def test_prompt_logprobs_survive_preemption(checkpoints, hf_models):
    """A pool too small for the batch preempts requests (recompute) in the middle of their prompts and outputs;
    each prompt's logprobs still come once, complete and right."""
    llm = LLM(model=str(checkpoints["llama"]), dtype="float32", block_token_num=8, num_device_blocks=16,
              split_fuse_token_num=12, max_step_tokens=24)
    prompts = random_prompts([44, 37, 30, 41], seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=40, min_tokens=40, prompt_logprobs=TOP)
    results = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.stats.num_preemptions > 0
    for result in results:
        assert_matches_transformers(result, hf_models["llama"])
        assert len(result.outputs[0].token_ids) == 40


def test_n_children_each_carry_the_prompt_logprobs(checkpoints, hf_models):
    llm = LLM(model=str(checkpoints["qwen2-mixed-swa"]), dtype="float32")
    result = llm.generate(random_prompts([20], seed=2), SamplingParams(n=3, seed=1, max_tokens=3, prompt_logprobs=1),
                          use_tqdm=False)[0]
    assert len(result.outputs) == 3
    assert_matches_transformers(result, hf_models["qwen2-mixed-swa"], top=1)
