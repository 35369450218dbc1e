"""Token parity with ``transformers`` with the prefix cache on: misses, then hits (partial and full-prompt) on
prompts sharing a 70-token prefix, longer than the sliding windows of ``qwen2-mixed-swa`` (16) and ``mistral``
(20); ``n > 1`` children sharing their prompt; and two engines sharing one remote store directory."""

from __future__ import annotations

import pytest
import torch

from ksana import LLM, SamplingParams
from tests.model_factory import load_hf_model, make_checkpoint, random_prompts

NUM_NEW = 12
FAMILIES = ["llama", "qwen2-mixed-swa", "mistral"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, min_tokens=NUM_NEW)


def _prompts() -> list[list[int]]:
    prefix, *suffixes = random_prompts([70, 9, 30, 1], seed=5)
    # Distinct suffixes, the bare prefix (a full-prompt hit once cached) and a prompt ending on a block boundary.
    return [prefix + s for s in suffixes] + [prefix, prefix[:64]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix-parity")
    return {family: make_checkpoint(root / family, family) for family in FAMILIES}


@pytest.fixture(scope="module")
def hf_reference(checkpoints):
    reference = {}
    for family in FAMILIES:
        model = load_hf_model(checkpoints[family], torch.float32)
        outs = []
        for prompt in _prompts():
            with torch.inference_mode():
                out = model.generate(torch.tensor([prompt]), max_new_tokens=NUM_NEW, min_new_tokens=NUM_NEW,
                                     do_sample=False)
            outs.append(out[0, len(prompt):].tolist())
        reference[family] = outs
    return reference


def _tokens(results) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in results]


@pytest.mark.parametrize("family", FAMILIES)
def test_hits_and_misses_match_transformers(family, checkpoints, hf_reference):
    llm = LLM(model=str(checkpoints[family]), dtype="float32", block_token_num=16, enable_auto_prefix_cache=True,
              max_step_tokens=96, split_fuse_token_num=48)
    prompts = _prompts()
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert _tokens(first) == hf_reference[family]
    manager = llm.engine.cache_manager
    hits_before = manager.stats.prefix_cache_hit_token_num
    second = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert _tokens(second) == hf_reference[family]
    stats = manager.stats
    # Every prompt of the second round hits at least the 64 cached prefix tokens (4 blocks).
    assert stats.prefix_cache_hit_token_num - hits_before >= 64 * len(prompts) - 16
    assert stats.full_prompt_matched_req_num > 0
    assert first[0].num_cached_tokens == 0 and all(r.num_cached_tokens >= 48 for r in second)
    manager.check_invariants()
    assert manager.num_free_blocks == llm.engine.num_blocks
    if manager.swa is not None:
        assert manager.swa.num_total_blocks == llm.engine.num_blocks


@pytest.mark.parametrize("family", ["qwen2-mixed-swa", "mistral"])
def test_n_children_share_the_prompt(family, checkpoints, hf_reference):
    llm = LLM(model=str(checkpoints[family]), dtype="float32", block_token_num=16, enable_auto_prefix_cache=True)
    prompts = _prompts()[:2]
    greedy_n = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, min_tokens=NUM_NEW, n=3)
    results = llm.generate(prompts, greedy_n, use_tqdm=False)
    for result, expected in zip(results, hf_reference[family][:2], strict=True):
        assert [c.token_ids for c in result.outputs] == [expected] * 3
    # The children of a prompt run in one step: the second and third reuse the first's prompt blocks.
    assert llm.engine.cache_manager.stats.prefix_cache_hit_req_num >= 4

    sampled = SamplingParams(temperature=0.8, max_tokens=NUM_NEW, n=3, seed=7, ignore_eos=True)
    with_cache = llm.generate(prompts, sampled, use_tqdm=False)
    plain = LLM(model=str(checkpoints[family]), dtype="float32", block_token_num=16)
    without_cache = plain.generate(prompts, sampled, use_tqdm=False)
    assert [[c.token_ids for c in r.outputs] for r in with_cache] == \
        [[c.token_ids for c in r.outputs] for r in without_cache]


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_second_engine_loads_the_first_engines_prefix_from_the_remote_store(family, checkpoints, hf_reference,
                                                                            tmp_path):
    kwargs = dict(model=str(checkpoints[family]), dtype="float32", block_token_num=16,
                  enable_auto_prefix_cache=True, remote_cache_dir=str(tmp_path / "remote"))
    prompts = _prompts()[:1]
    first = LLM(**kwargs)
    assert _tokens(first.generate(prompts, GREEDY, use_tqdm=False)) == hf_reference[family][:1]
    assert first.engine.cache_manager.stats.prefix_cache_hit_token_num == 0
    assert list((tmp_path / "remote").rglob("*.safetensors")), "the first engine wrote its full blocks"

    second = LLM(**kwargs)
    results = second.generate(prompts, GREEDY, use_tqdm=False)
    assert _tokens(results) == hf_reference[family][:1]
    stats = second.engine.cache_manager.stats
    assert stats.remote_loaded_block_num == (len(prompts[0]) - 1) // 16
    assert stats.prefix_cache_hit_token_num == 16 * stats.remote_loaded_block_num
    second.engine.cache_manager.check_invariants()
