"""The model's perf hooks: free when off, exact when on, and the profiler's bookkeeping."""

from __future__ import annotations

import pytest
import torch

from ksana import LLM, SamplingParams
from ksana.kernels import attention
from ksana.kernels.cpu.ops import NativeCPUOps
from ksana.kernels.dispatch import TORCH_OPS, KernelOps, get_ops
from ksana.perf.csv_writer import csv_row
from ksana.perf.operator_profiler import OPERATORS, OperatorProfiler
from ksana.perf.perf_config import BatchSpec, RequestSpec
from ksana.perf.stats import summarize
from tests.kernels.test_attention import ROWS, make_batch

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# 40-token prompts with a 64-token step budget, each whole (one prefill attention per prompt and layer): later
# prompts prefill beside earlier ones' decodes (mixed steps).
PROMPTS = [[(7 * i + j) % 1000 + 3 for j in range(40)] for i in range(3)]


@pytest.fixture(scope="module")
def llm():
    return LLM(model="demo", max_step_tokens=64, split_fuse_token_num=0)


def _tokens(llm):
    return [r.outputs[0].token_ids for r in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_profiling_off_leaves_the_plain_kernels_in_place(llm):
    model = llm.engine.model
    plain_ops = get_ops(llm.engine.device)
    assert model.profiler is None and model.ops is plain_ops
    assert all(layer.ops is layer.self_attn.ops is layer.mlp.ops is plain_ops for layer in model.layers)
    # The raw builtin or the native kernel's method (AVX-512): no wrapper on the hot path.
    assert getattr(plain_ops.qkv_proj, "__func__", plain_ops.qkv_proj) in (torch.nn.functional.linear,
                                                                           NativeCPUOps.linear)


def test_timed_forward_gives_the_same_tokens_and_counts_every_op(llm):
    model = llm.engine.model
    plain = _tokens(llm)
    device = llm.engine.device
    profiler = OperatorProfiler(device, model.shape.num_layers)
    model.set_profiler(profiler)
    try:
        assert model.ops.name == f"{get_ops(device).name}+timed" and model.layers[1].mlp.ops is model.ops
        timed = _tokens(llm)
        times = profiler.take()
    finally:
        model.set_profiler(None)
    assert model.ops is get_ops(device)
    assert timed == plain
    num_forwards = times.calls["embedding"]
    assert num_forwards == times.calls["lm_head"] >= 6
    assert times.calls["qkv_proj"] == times.calls["mlp_down"] == num_forwards * model.shape.num_layers
    assert times.calls["kv_cache_store"] == num_forwards * model.shape.num_layers  # apart from attention
    assert times.calls["attention_prefill"] == len(PROMPTS) * model.shape.num_layers
    assert 0 < times.calls["attention_decode"] < num_forwards * model.shape.num_layers  # not in the first step
    assert times.calls["sampler"] == times.calls["all_reduce"] == 0  # the runner times the sampler
    assert all(t > 0 for t in times.per_layer_s["qkv_proj"]) and times.outside_layers_s["qkv_proj"] == 0
    assert times.outside_layers_s["lm_head"] > 0 and sum(times.per_layer_s["lm_head"]) == 0
    assert times.forward_total_s <= times.span_s


def test_layer_forward_round_repeats_layers_without_changing_outputs(llm):
    model = llm.engine.model
    plain = _tokens(llm)
    profiler = OperatorProfiler(llm.engine.device, model.shape.num_layers)
    model.set_profiler(profiler)
    model.set_layer_forward_round(3)
    try:
        repeated = _tokens(llm)
        times = profiler.take()
    finally:
        model.set_layer_forward_round(1)
        model.set_profiler(None)
    assert repeated == plain
    assert times.calls["qkv_proj"] == 3 * times.calls["embedding"] * model.shape.num_layers
    with pytest.raises(ValueError, match="layer_forward_round"):
        model.set_layer_forward_round(0)


@pytest.mark.parametrize("window", [None, 6])
def test_timed_attention_is_the_reference_split_in_two(window):
    (k_cache, v_cache), (q, k, v), meta, _, _ = make_batch(ROWS, 6, 2, 16)
    expected = attention.paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, 0.25, window)
    profiler = OperatorProfiler("cpu", num_layers=1)
    timed = TORCH_OPS.timed(profiler)
    out = timed.paged_attention(q, k, v, k_cache, v_cache, meta, 0.25, window)
    assert torch.equal(out, expected)
    times = profiler.take()
    num_decodes = meta.num_decodes
    assert (times.calls["attention_decode"], times.calls["attention_prefill"]) == (1, len(ROWS) - num_decodes)
    assert times.calls["kv_cache_store"] == 1


def test_a_fused_attention_kernel_is_timed_whole():
    calls = []

    def fused(query, key, value, k_cache, v_cache, meta, scale, sliding_window=None):
        calls.append(meta.num_decodes)
        return query

    ops = KernelOps(name="fused", rms_norm=None, fused_add_rms_norm=None, silu_and_mul=None, rotary_cos_sin=None,
                    apply_rotary=None, store_kv_cache=None, paged_attention=fused)
    profiler = OperatorProfiler("cpu", num_layers=1)
    timed = ops.timed(profiler)
    (k_cache, v_cache), (q, k, v), meta, _, _ = make_batch([(1, 5), (1, 9)], 4, 2, 16)
    timed.paged_attention(q, k, v, k_cache, v_cache, meta, 1.0)
    (k_cache, v_cache), (q, k, v), meta, _, _ = make_batch([(1, 5), (4, 9)], 4, 2, 16)
    timed.paged_attention(q, k, v, k_cache, v_cache, meta, 1.0)
    times = profiler.take()
    assert calls == [2, 1]
    assert (times.calls["attention_decode"], times.calls["attention_prefill"], times.calls["kv_cache_store"]) == (
        1, 1, 0)


def test_a_fused_kernel_with_its_attention_apart_times_the_store_apart():
    """Triton's case: ``attend_cached`` is the fused kernel after its store, so the store is timed on its own."""
    calls = []

    def attend(query, k_cache, v_cache, meta, scale, sliding_window=None):
        calls.append(("attend", meta.num_decodes, sliding_window))
        return 2 * query

    ops = KernelOps(name="fused", rms_norm=None, fused_add_rms_norm=None, silu_and_mul=None, rotary_cos_sin=None,
                    apply_rotary=None, store_kv_cache=lambda *args: calls.append(("store", len(args))),
                    paged_attention=None, attend_cached=attend)
    profiler = OperatorProfiler("cpu", num_layers=1)
    timed = ops.timed(profiler)
    (k_cache, v_cache), (q, k, v), meta, _, _ = make_batch([(1, 5), (1, 9)], 4, 2, 16)
    assert torch.equal(timed.paged_attention(q, k, v, k_cache, v_cache, meta, 1.0, 6), 2 * q)
    (k_cache, v_cache), (q, k, v), meta, _, _ = make_batch([(1, 5), (4, 9)], 4, 2, 16)
    timed.paged_attention(q, k, v, k_cache, v_cache, meta, 1.0)
    times = profiler.take()
    assert calls == [("store", 5), ("attend", 2, 6), ("store", 5), ("attend", 1, None)]
    assert (times.calls["attention_decode"], times.calls["attention_prefill"], times.calls["kv_cache_store"]) == (
        1, 1, 2)


def test_profiler_attributes_calls_to_layers_and_clears_on_take():
    profiler = OperatorProfiler("cpu", num_layers=2)
    double = profiler.wrap("mlp_down", lambda x: 2 * x)
    with pytest.raises(ValueError, match="unknown operator"):
        profiler.wrap("softmax", abs)
    assert double(3) == 6  # outside the layers
    profiler.layer = 1
    double(1)
    double(1)
    times = profiler.take()
    assert times.calls["mlp_down"] == 3 and set(times.calls) == set(OPERATORS)
    assert times.per_layer_s["mlp_down"][0] == 0 and times.per_layer_s["mlp_down"][1] > 0
    assert times.total_s("mlp_down") == pytest.approx(sum(times.per_layer_s["mlp_down"]) + times.outside_layers_s["mlp_down"])
    assert profiler.take().calls["mlp_down"] == 0
    with_sampler = times.with_sampler(0.5)
    assert with_sampler.calls["sampler"] == 1 and with_sampler.total_s("sampler") == 0.5
    assert with_sampler.forward_total_s == times.forward_total_s


def test_summary_statistics():
    stats = summarize([4.0, 1.0, 3.0, 2.0, 10.0])
    assert stats == {"mean": 4.0, "p50": 3.0, "p90": 7.6, "p99": 9.76, "min": 1.0, "max": 10.0,
                     "std": pytest.approx(3.1623, abs=1e-4)}
    assert summarize([2.5])["std"] == 0.0 and summarize([2.5])["p99"] == 2.5


def test_csv_row_is_ksanallm_format():
    batch = BatchSpec("batch_0", (RequestSpec(128, 192, 2), RequestSpec(128, 192, 1), RequestSpec(1, 513, 4)))
    assert csv_row(batch, 100, 6, 12.34567) == "100,6,7,2628,3,192.000,128.000, 4,513.000,1.000,12.346"
