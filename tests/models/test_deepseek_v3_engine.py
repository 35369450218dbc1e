"""DeepSeek-V3 through the whole engine: greedy tokens as ``transformers`` ``generate`` gives them.

A batch of 8 prompts of 5 to 300 tokens, greedy, 32 new tokens, float32: plain, with chunked prefill, with a KV pool
so small that requests are preempted and recomputed, and with the prefix cache on (misses, then hits). bfloat16 is
checked token by token against transformers' bfloat16 logits of the same sequences (teacher forcing): a bfloat16
MoE flips an expert choice where two scores nearly tie, so two correct bfloat16 runs may part ways, and a broken
one disagrees on most tokens.
"""

from __future__ import annotations

import pytest
import torch

from ksana import LLM, SamplingParams
from tests.model_factory import hf_logits, load_hf_model, make_checkpoint, random_prompts

PROMPT_LENGTHS = [5, 17, 32, 64, 100, 150, 211, 300]
NUM_NEW = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, min_tokens=NUM_NEW, logprobs=0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("deepseek-parity"), "deepseek_v3")


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(PROMPT_LENGTHS, seed=11)


@pytest.fixture(scope="module")
def hf_reference(checkpoint, prompts):
    """HF greedy tokens and the chosen tokens' logprobs, per prompt."""
    model = load_hf_model(checkpoint, torch.float32)
    reference = []
    for prompt in prompts:
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=NUM_NEW, min_new_tokens=NUM_NEW,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True)
        tokens = out.sequences[0, len(prompt):].tolist()
        logprobs = [torch.log_softmax(step[0].float(), -1)[tok].item()
                    for step, tok in zip(out.logits, tokens, strict=True)]
        reference.append((tokens, logprobs))
    return reference


def _generate(path, prompts, dtype="float32", **overrides):
    llm = LLM(model=str(path), dtype=dtype, block_token_num=16, **overrides)
    return llm, llm.generate(prompts, GREEDY, use_tqdm=False)


def _assert_matches(results, reference):
    for i, (result, (tokens, logprobs)) in enumerate(zip(results, reference, strict=True)):
        completion = result.outputs[0]
        assert completion.token_ids == tokens, f"prompt {i} ({len(result.prompt_token_ids)} tokens)"
        assert completion.finish_reason == "length"
        assert completion.token_logprobs == pytest.approx(logprobs, abs=1e-4), f"prompt {i}"


@pytest.mark.parametrize(
    "overrides",
    [{}, {"split_fuse_token_num": 24, "max_step_tokens": 64}, {"num_device_blocks": 24}],
    ids=["plain", "chunked-prefill", "preemption"],
)
def test_greedy_tokens_match_transformers(checkpoint, prompts, hf_reference, overrides):
    llm, results = _generate(checkpoint, prompts, **overrides)
    _assert_matches(results, hf_reference)
    stats = llm.engine.scheduler.stats
    if "num_device_blocks" in overrides:
        # 24 blocks of 16 tokens: the longest request (332 tokens) fits alone, the batch does not.
        assert stats.num_preemptions > 0
    if "max_step_tokens" in overrides:
        assert stats.num_steps > NUM_NEW + sum(PROMPT_LENGTHS) // 64
    assert llm.engine.cache_manager.num_free_blocks == llm.engine.num_blocks


def test_prefix_cache_hits_match_transformers(checkpoint, prompts, hf_reference):
    """Every prompt twice with the prefix cache on: the second round hits the first round's blocks."""
    llm = LLM(model=str(checkpoint), dtype="float32", block_token_num=16, enable_auto_prefix_cache=True,
              max_step_tokens=96, split_fuse_token_num=48)
    for round_ in range(2):
        results = llm.generate(prompts, GREEDY, use_tqdm=False)
        _assert_matches(results, hf_reference)
        if round_:
            assert all(r.num_cached_tokens >= 16 * ((len(p) - 1) // 16) for r, p in zip(results, prompts,
                                                                                        strict=True))
    assert llm.engine.cache_manager.stats.prefix_cache_hit_token_num > 0
    llm.engine.cache_manager.check_invariants()


@pytest.mark.parametrize("overrides", [{}, {"split_fuse_token_num": 24, "max_step_tokens": 64}],
                         ids=["plain", "chunked-prefill"])
def test_bfloat16_tokens_agree_with_transformers(checkpoint, prompts, overrides):
    """Each generated token against transformers' bfloat16 logits of the prompt plus the tokens before it: nearly
    every token is its argmax, with its logprob."""
    _, results = _generate(checkpoint, prompts, dtype="bfloat16", **overrides)
    hf = load_hf_model(checkpoint, torch.bfloat16)
    argmax = close = total = 0
    for result, prompt in zip(results, prompts, strict=True):
        completion = result.outputs[0]
        assert len(completion.token_ids) == NUM_NEW
        logits = hf_logits(hf, prompt + completion.token_ids)[len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits, -1)
        for step, token in enumerate(completion.token_ids):
            argmax += int(token == int(logits[step].argmax()))
            close += int(abs(completion.token_logprobs[step] - float(expected[step, token])) < 0.1)
            total += 1
    assert argmax >= 0.9 * total and close >= 0.9 * total, (argmax, close, total)


def test_perf_hooks_time_the_mla_kernels_without_changing_tokens(checkpoint, prompts, hf_reference):
    from ksana.perf.operator_profiler import OperatorProfiler

    llm = LLM(model=str(checkpoint), dtype="float32", block_token_num=16)
    model = llm.engine.model
    profiler = OperatorProfiler(llm.engine.device, model.shape.num_layers)
    model.set_profiler(profiler)
    model.set_layer_forward_round(2)
    try:
        results = llm.generate(prompts, GREEDY, use_tqdm=False)
        times = profiler.take()
    finally:
        model.set_layer_forward_round(1)
        model.set_profiler(None)
    _assert_matches(results, hf_reference)
    layer_calls = 2 * times.calls["embedding"] * model.shape.num_layers
    assert times.calls["kv_cache_store"] == times.calls["qkv_proj"] // 2 == layer_calls
    assert times.calls["attention_prefill"] == 2 * len(prompts) * model.shape.num_layers
    assert times.calls["attention_decode"] > 0
    assert all(t > 0 for t in times.per_layer_s["attention_decode"])
    assert model.ops is model.plain_ops and model.layers[1].self_attn.ops is model.plain_ops
