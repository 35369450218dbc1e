"""Tensor parallelism on CPU over gloo: TP=2 must generate exactly what TP=1 does, hold half the weights, and
fail loudly when a rank raises or dies: the error names the rank and what happened to it (its exception, the signal
that killed it), which a collective's timeout would not."""

from __future__ import annotations

import os
import signal

import pytest

from ksana import LLM, SamplingParams
from ksana.config import ConfigError
from ksana.models.parallel import check_tp_size
from ksana.models.shape import ModelShape
from tests.model_factory import make_checkpoint, random_prompts, tiny_config

# A small pool, 4-token blocks, 8-token chunks and a 24-token step budget: chunked prefill and preemption.
# On the CPU (gloo) wherever the tests run: two ranks need two GPUs, and a machine with one would fail them.
ENGINE = dict(num_device_blocks=14, block_token_num=4, split_fuse_token_num=8, max_step_tokens=24, device="cpu")
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPT_LENGTHS = [5, 17, 40, 9, 23]


def _tokens(llm: LLM, prompts) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    return {family: make_checkpoint(root, family) for family in ("llama", "qwen2")}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tp2_greedy_equals_tp1_with_chunked_prefill_and_preemption(checkpoints, tp_llm, family):
    prompts = random_prompts(PROMPT_LENGTHS, seed=1)
    reference = LLM(model=str(checkpoints[family]), **ENGINE)
    expected = _tokens(reference, prompts)
    assert reference.engine.scheduler.stats.num_preemptions > 0

    llm = tp_llm(checkpoints[family], **ENGINE)
    assert llm.engine.tp_runner.world_size == 2
    assert llm.engine.model.rank_shape.num_kv_heads == 1  # 2 KV heads split over 2 ranks
    assert _tokens(llm, prompts) == expected
    assert llm.engine.scheduler.stats.num_preemptions > 0

    # Prompt logprobs come from the logits of every prompt position, gathered across the ranks' vocabulary shards.
    asked = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    for want, got in zip(reference.generate(prompts, asked, use_tqdm=False), llm.generate(prompts, asked,
                                                                                        use_tqdm=False), strict=True):
        assert len(got.prompt_logprobs) == len(want.prompt_logprobs) == len(want.prompt_token_ids)
        for got_entry, want_entry in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True):
            assert list(got_entry) == list(want_entry)
            assert [v.logprob for v in got_entry.values()] == pytest.approx(
                [v.logprob for v in want_entry.values()], abs=1e-4)

    # Each rank holds half of every split weight; only the norms are replicated.
    full = sum(p.numel() * p.element_size() for p in reference.engine.model.parameters())
    shape = reference.engine.shape
    replicated = (2 * shape.num_layers + 1) * shape.hidden_size * 4
    per_rank = llm.engine.tp_runner.rank_param_bytes()
    assert per_rank == [(full - replicated) // 2 + replicated] * 2


def test_invalid_sizes_are_rejected_with_the_key():
    shape = ModelShape.from_hf_config(tiny_config("llama"), dtype=None)  # 6 heads, 2 KV heads, MLP 128
    with pytest.raises(ConfigError, match=r"tensor_para_size.*more ranks \(4\) than KV heads \(2\)"):
        check_tp_size(shape, 4)
    qwen = ModelShape.from_hf_config(tiny_config("qwen2", num_key_value_heads=4, num_attention_heads=4,
                                                 intermediate_size=130), dtype=None)
    with pytest.raises(ConfigError, match=r"MLP size 130 does not divide into 4"):
        check_tp_size(qwen, 4)
    heads = ModelShape.from_hf_config(tiny_config("llama", num_key_value_heads=3, num_attention_heads=6),
                                      dtype=None)
    with pytest.raises(ConfigError, match=r"3 KV heads do not divide into 2.*"):
        check_tp_size(heads, 2)
    check_tp_size(shape, 2)


def test_engine_rejects_invalid_size_before_spawning(checkpoints):
    with pytest.raises(ConfigError, match=r"setting\.global\.tensor_para_size' = 3 is invalid"):
        LLM(model=str(checkpoints["llama"]), tensor_para_size=3)


def _assert_fails_naming_rank_1(llm: LLM, prompts, pattern: str) -> None:
    with pytest.raises(Exception) as info:
        llm.generate(prompts, GREEDY, use_tqdm=False)
    chain, exc = [], info.value
    while exc is not None:
        chain.append(str(exc))
        exc = exc.__cause__
    assert any("tensor-parallel rank 1" in text and pattern in text for text in chain), chain
    # The engine is stopped for good: the ranks are gone and another step fails at once.
    assert all(proc.poll() is not None for proc in llm.engine.tp_runner.procs)
    with pytest.raises(Exception, match="rank 1"):
        llm.generate(prompts[:1], GREEDY, use_tqdm=False)


def test_rank_that_raises_stops_the_engine_naming_it(checkpoints, tp_llm, monkeypatch):
    monkeypatch.setenv("KSANA_TP_FAIL_AT_STEP", "1:3")
    llm = tp_llm(checkpoints["llama"], **ENGINE)
    _assert_fails_naming_rank_1(llm, random_prompts([6, 11], seed=2), "injected failure at step 3")


def test_rank_that_dies_stops_the_engine_naming_it(checkpoints, tp_llm):
    llm = tp_llm(checkpoints["llama"], **ENGINE)
    prompts = random_prompts([6, 11], seed=3)
    assert len(_tokens(llm, prompts)[0]) == GREEDY.max_tokens
    proc = llm.engine.tp_runner.procs[0]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    _assert_fails_naming_rank_1(llm, prompts, "killed by signal 9")
