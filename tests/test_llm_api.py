"""The offline API on the demo model: sampling reproducibility, stops, n, logprobs and bad input."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest

from ksana import LLM, SamplingParams
from ksana.config import ConfigError
from ksana.sampling_params import SamplingParamsError

PROMPTS = ["the quick brown fox", "hello", "a much longer prompt about cats and dogs and the weather today", "x y"]


@pytest.fixture(scope="module")
def llm():
    return LLM(model="demo", block_token_num=8, max_batch_size=16)


def _tokens(results):
    return [r.outputs[0].token_ids for r in results]


def test_seeded_request_reproduces_alone_and_inside_a_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.8, seed=7, max_tokens=30, ignore_eos=True)
    batch = llm.generate([PROMPTS[2], PROMPTS[0], PROMPTS[1]], [others, params, others], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    unseeded = llm.generate([PROMPTS[0]] * 2, SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True),
                            use_tqdm=False)
    assert _tokens(unseeded)[0] != _tokens(unseeded)[1], "unseeded requests draw independently"


def test_top_k_one_equals_greedy(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    top1 = llm.generate(PROMPTS, SamplingParams(temperature=1.5, top_k=1, seed=3, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)
    assert _tokens(top1) == _tokens(greedy)


def test_stop_string_is_cut_from_the_text(llm):
    base = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    full = llm.generate([PROMPTS[0]], base, use_tqdm=False)[0].outputs[0]
    stop = full.text[10:14]
    assert len(stop) == 4
    cut = full.text.index(stop)
    stopped = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, stop=[stop]),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[:cut]
    assert stopped.token_ids == full.token_ids[: len(stopped.token_ids)]
    assert len(stopped.token_ids) < len(full.token_ids)


def test_stop_token_ids_and_min_tokens(llm):
    full = llm.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    stop_id = full.token_ids[4]
    first = full.token_ids.index(stop_id)
    out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop_id]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == full.token_ids[: first + 1]
    # min_tokens bans the stop token until the minimum is reached: the output never ends early.
    out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12,
                                                    stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 12 and out.finish_reason == "length"
    assert stop_id not in out.token_ids


def test_n_completions_and_top_logprobs(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True, logprobs=3)
    result = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    assert [o.index for o in result.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in result.outputs}) == 3
    for completion in result.outputs:
        assert len(completion.logprobs) == len(completion.token_ids) == 12
        for token, entry in zip(completion.token_ids, completion.logprobs, strict=True):
            assert token in entry and 3 <= len(entry) <= 4
            assert all(lp <= 0.0 for lp in entry.values())


def test_outputs_keep_prompt_order_and_accept_token_ids(llm):
    ids = llm.tokenizer(PROMPTS[2])["input_ids"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    by_text = llm.generate(PROMPTS, params, use_tqdm=False)
    by_ids = llm.generate([ids], params, use_tqdm=False)
    assert by_ids[0].prompt_token_ids == ids == by_text[2].prompt_token_ids
    assert by_ids[0].outputs[0].token_ids == by_text[2].outputs[0].token_ids
    assert [r.prompt for r in by_text] == PROMPTS


def test_bad_input_is_a_clear_error(llm):
    with pytest.raises(SamplingParamsError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(SamplingParamsError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 2, 10**6]], use_tqdm=False)
    with pytest.raises(ValueError, match="the prompt has 3000 tokens"):
        llm.generate([[5] * 3000], use_tqdm=False)
    with pytest.raises(ConfigError, match="max_batch_sz"):
        LLM(model="demo", max_batch_sz=3)
    with pytest.raises(ConfigError, match="mtp_step_num.*no MTP modules"):
        LLM(model="demo", mtp_step_num=1)
    # The engine keeps working after rejected requests, and nothing leaked.
    assert llm.generate(["ok"], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    assert llm.engine.cache_manager.num_free_blocks == llm.engine.num_blocks


def test_every_forward_runs_on_the_engines_one_forward_thread(llm):
    """One thread for the engine's life (one OpenMP pool), across generate calls, never the caller's."""
    runner, threads = llm.engine.runner, []
    execute = runner.execute

    def recording_execute(plan):
        threads.append(threading.current_thread())
        return execute(plan)

    runner.execute = recording_execute
    try:
        for _ in range(2):
            llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    finally:
        del runner.execute
    assert len(threads) >= 6 and set(threads) == {llm.engine.forward_lane.thread}
    assert threads[0].name == "ksana-forward" and threads[0] is not threading.main_thread()


def test_an_llm_dropped_without_closing_frees_its_model_and_ends_its_forward_thread():
    """Scripts, tests and benchmarks build one engine after another: a dropped one must not keep its weights, its
    KV cache and an idle thread (with that thread's OpenMP pool) for the rest of the process."""
    llm = LLM(model="demo", block_token_num=8)
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    model, kv_cache = weakref.ref(llm.engine.model), weakref.ref(llm.engine.kv_cache)
    thread = llm.engine.forward_lane.thread
    del llm
    gc.collect()  # a finished loop's actors and the engine's parts refer to each other
    thread.join(timeout=60)  # returns at once when the thread ends; the timeout only bounds a failure
    assert model() is None and kv_cache() is None and not thread.is_alive()


def test_start_up_objects_are_frozen_out_of_the_collectors_sight():
    """The engine's start-up objects (its model among them) sit in the permanent generation, out of every
    collection the decode loop's garbage triggers."""
    gc.unfreeze()
    engine = LLM(model="demo", block_token_num=8).engine
    assert gc.get_freeze_count() > 0
    assert gc.is_tracked(engine.model) and not any(o is engine.model for o in gc.get_objects())


def test_the_engine_allocates_the_kv_cache_layout_its_kernels_ask_for(llm):
    model = llm.engine.model
    assert model.kv_head_major == (model.ops.name == "cpu-native")
    k_cache, v_cache = llm.engine.kv_cache.layers[0]
    assert k_cache.transpose(1, 2).is_contiguous() == model.kv_head_major != k_cache.is_contiguous()
    assert v_cache.stride() == k_cache.stride()
