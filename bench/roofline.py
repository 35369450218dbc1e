"""Decode against the roofline, prefill against ``transformers``, and the engine's overhead, in one run.

1. Both ceilings of this machine, measured in the same run (before the decode runs and after each pass of them,
   best of each; the read ceiling is then raised to the fastest rate a decode run read its bytes at, where that is
   higher):
   read bandwidth (the fastest of three readers on all threads: a large float32 tensor's ``sum``, a
   matrix-vector product, and the engine's own projection kernel streaming as many bytes of weight at one input
   row) and the float32 matmul rate (a square GEMM, the faster of ``torch.mm`` and the engine's packed kernel).
   Beside them, not part of the bound: the rate at which that kernel streams one weight matrix of the model's size
   from memory at each batch's row count. Where the arithmetic
   of B rows and the weight stream do not overlap fully, this is below the read bandwidth, and a step made of
   nothing but that one uninterrupted matmul could not beat it; "step/kernel" sets the step against it.
2. Decode at batch 1 and 16 (float32) through ``LLM.generate``: B prompts of a fixed context, ``ignore_eos``.
   Every configuration runs ``decode_passes`` times, the passes one after the other (each configuration once,
   then again), and the fastest pass (lowest median step) counts, as the fastest ceiling measurement does: a
   shared VM's speed drifts by 20-40% within minutes, and best against best compares the machine with itself. Per
   steady decode step (every row decoding, the full batch), the worker step (``ExecuteStep`` handling in the
   event trace) and the whole step (from one ``ExecuteStep`` start to the next, and from one ``TokensOut`` to the
   next) against the bound max(bytes read / bandwidth, FLOPs / matmul rate). Bytes: every weight once (the
   lm_head as vocab x hidden, tied or not; the embedding lookup only its B rows) plus each sequence's KV; FLOPs:
   2 x matmul parameters x tokens plus attention's 4 x kv_len x heads x head_dim per token and layer. Both come
   from the model's ``ModelShape``. Beside it, "paired": each pass against the ceilings measured just before and
   after it, the median over the passes (``paired_ratios``), which a ceiling caught in a fast minute of the
   machine cannot set against steps from a slow one.
3. Prefill of one 512-token prompt: Ksana's prefill step (from the trace) against ``transformers``'
   ``AutoModelForCausalLM`` forward of the same tokens (``logits_to_keep=1``, as its ``generate`` does), in
   float32 and bfloat16, the two engines alternating run by run.
4. Engine overhead at batch 16: each decode step's period split along its critical path (worker prepare /
   forward / sample / dispatch, the ``StepResult`` queue, the scheduler's handling with the cache manager's
   exchange inside it, the ``ExecuteStep`` queue); the I/O actor's ``TokensOut`` handling (detokenization) runs
   while the next forward does, and is shown beside it.

The trace holds message times only; the worker's ``StepTimings`` (prepare / forward / sample) are read by wrapping
this engine's ``runner.execute`` (``StepRecorder``).

    python bench/roofline.py            # smollm2: decode at contexts 128 and 512, prefill of 512 tokens
    python bench/roofline.py --quick    # the demo model, small shapes: checks the script in seconds

A full run writes ``bench/results/roofline_<machine kind>.json``, a ``--quick`` one ``roofline_quick.json``.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import orjson
import torch
from transformers import AutoConfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from ksana import LLM, SamplingParams  # noqa: E402
from ksana.bench.results import default_out, write_json  # noqa: E402
from ksana.builtin import resolve_model_dir  # noqa: E402
from ksana.events.trace import TraceRecord  # noqa: E402
from ksana.kernels.dispatch import get_ops  # noqa: E402
from ksana.messages import PromptLogprobs, SampledToken, StepPlan, StepTimings  # noqa: E402
from ksana.models.shape import ModelShape  # noqa: E402
from ksana.worker.fresh_thread import run_in_fresh_thread  # noqa: E402

RESULTS = Path(__file__).parent / "results"


@attrs.frozen
class Settings:
    model: str = "smollm2"
    batches: tuple[int, ...] = (1, 16)
    contexts: tuple[int, ...] = (128, 512)
    decode_tokens: int = 32
    decode_passes: int = 3  # runs of each decode configuration; the fastest counts
    skip_steps: int = 2  # first decode steps left out (allocator and caches warming)
    prefill_len: int = 512
    prefill_dtypes: tuple[str, ...] = ("float32", "bfloat16")
    prefill_repeats: dict[str, int] = attrs.field(factory=lambda: {"float32": 7, "bfloat16": 5})
    bandwidth_mib: int = 512
    gemm_n: int = 2048
    ceiling_repeats: int = 7


QUICK = Settings(model="demo", batches=(1, 4), contexts=(16, 48), decode_tokens=8, prefill_len=64,
                 prefill_repeats={"float32": 3, "bfloat16": 2}, bandwidth_mib=64, gemm_n=512, ceiling_repeats=3)


# ---- ceilings -----------------------------------------------------------------------------------------------------
def measure_read_bandwidth(mib: int, repeats: int, one_row: dict[str, Any]) -> dict[str, Any]:
    """Bytes/s reading ``mib`` MiB of float32 on all intra-op threads, best of repeats of three readers: a flat
    ``sum``, a matrix-vector product (the decode step's own access pattern) and ``one_row``, the engine's
    projection kernel streaming a weight of the same size at one input row (``measure_streamed_matmul``). The
    machine reads at least as fast as the fastest of them, so that one is the ceiling: the kernel prefetches its
    stream in software and can outread ``sum`` (``roofline_*.json``'s ``by_reader_bytes_per_s``), and a ceiling
    below what the machine demonstrably reads would flatter every ratio."""
    x = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    matrix = x.view(1024, -1)
    vector = torch.ones(matrix.shape[1])
    readers = {"sum": x.sum, "mv": lambda: torch.mv(matrix, vector)}
    rates = {}
    for name, fn in readers.items():
        fn()
        rates[name] = x.numel() * 4 / min(_timed(fn) for _ in range(repeats))
    rates["linear 1 row"] = one_row["bytes_per_s"]
    reader = max(rates, key=rates.__getitem__)
    return {"bytes": x.numel() * 4, "bytes_per_s": rates[reader], "reader": reader, "by_reader_bytes_per_s": rates}


def measure_ceilings(settings: Settings, hidden_size: int) -> dict[str, Any]:
    streamed = {str(rows): measure_streamed_matmul(settings.bandwidth_mib, hidden_size, rows,
                                                   settings.ceiling_repeats)
                for rows in settings.batches}
    one_row = streamed.get("1") or measure_streamed_matmul(settings.bandwidth_mib, hidden_size, 1,
                                                           settings.ceiling_repeats)
    return {"read_bandwidth": measure_read_bandwidth(settings.bandwidth_mib, settings.ceiling_repeats, one_row),
            "matmul": measure_matmul_rate(settings.gemm_n, settings.ceiling_repeats),
            "streamed_matmul": streamed}


def best_ceilings(*runs: dict[str, Any]) -> dict[str, Any]:
    """Per ceiling, the best of several measurements (the machine is shared: a slow one saw a neighbour)."""
    rows = runs[0]["streamed_matmul"]
    return {"read_bandwidth": max((r["read_bandwidth"] for r in runs), key=lambda c: c["bytes_per_s"]),
            "matmul": max((r["matmul"] for r in runs), key=lambda c: c["flop_per_s"]),
            "streamed_matmul": {b: max((r["streamed_matmul"][b] for r in runs), key=lambda c: c["bytes_per_s"])
                                for b in rows}}


def raise_to_decode_rate(ceilings: dict[str, Any], decode: list[dict[str, Any]], shape: ModelShape) -> dict[str, Any]:
    """The read ceiling, raised to the fastest rate a decode run read its bytes at (median step period) where
    that is higher: a step cannot read faster than the machine, so a lower measured ceiling was taken in a slow
    phase of a shared machine, and keeping it would flatter every ratio."""
    rates = {f"batch{d['batch']}_ctx{d['context']}": statistics.median(
        decode_step_cost(shape, s["seq_lens"])["bytes"] / s["period_s"] for s in d["steps"]) for d in decode}
    measured = ceilings["read_bandwidth"]
    fastest = max(rates, key=rates.__getitem__, default=None)
    read = dict(measured, decode_bytes_per_s=rates, measured_bytes_per_s=measured["bytes_per_s"],
                source="measured")
    if fastest is not None and rates[fastest] > measured["bytes_per_s"]:
        read.update(bytes_per_s=rates[fastest], source=f"decode {fastest}")
    return {**ceilings, "read_bandwidth": read}


def measure_matmul_rate(n: int, repeats: int) -> dict[str, Any]:
    """FLOP/s of an n x n x n float32 GEMM, best of repeats, the faster of two kernels: ``torch.mm`` and the engine's
    own projection kernel (a projection of ``get_ops("cpu")`` over the packed weight, where it runs). Why both:
    torch's ``mm`` can run at half its usual rate while the engine's kernels do not, and a halved matmul ceiling
    makes batch 16's bound its FLOPs and its ratio look met."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    kernels = {"torch.mm": lambda: torch.mm(a, b, out=out)}
    ops = get_ops("cpu")
    if ops.pack_weights is not None:
        packed = next(ops.pack_weights([b.t().contiguous()]))  # linear takes [out, in]: the same product
        kernels["packed linear"] = lambda: ops.mlp_gate_up(a, packed)
    rates = {}
    for name, fn in kernels.items():
        fn()
        rates[name] = 2 * n**3 / min(_timed(fn) for _ in range(repeats))
    kernel = max(rates, key=rates.__getitem__)
    return {"n": n, "flop_per_s": rates[kernel], "kernel": kernel, "by_kernel_flop_per_s": rates}


def measure_streamed_matmul(mib: int, in_features: int, rows: int, repeats: int) -> dict[str, Any]:
    """Weight bytes/s of the engine's CPU projection (``lm_head`` of ``get_ops("cpu")``: the packed AVX2 or
    AVX-512 kernel where it runs, BLAS otherwise) over one ``mib`` MiB float32 weight with ``in_features``
    columns, at ``rows`` input rows; best of repeats. At the default 512 MiB the weight is larger than the L3 of
    the machines in ``bench/README.md`` (16-480 MB), so every pass streams it from memory (``--quick``'s 64 MiB
    only checks the script)."""
    ops = get_ops("cpu")
    weight = torch.randn(mib * 2**20 // (4 * in_features), in_features) * 0.02
    nbytes = weight.numel() * 4
    if ops.pack_weights is not None:
        weight = next(ops.pack_weights([weight]))
    x = torch.randn(rows, in_features)
    ops.lm_head(x, weight)
    best = min(_timed(lambda: ops.lm_head(x, weight)) for _ in range(repeats))
    return {"rows": rows, "in_features": in_features, "bytes": nbytes, "best_s": best, "bytes_per_s": nbytes / best,
            "kernel": "packed" if ops.pack_weights is not None else "blas"}


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


# ---- the roofline model -------------------------------------------------------------------------------------------
def matmul_params(shape: ModelShape) -> int:
    """Weights every token multiplies through: per layer q/k/v/o and the gated MLP, plus the lm_head."""
    q = shape.num_heads * shape.head_dim
    kv = shape.num_kv_heads * shape.head_dim
    per_layer = shape.hidden_size * (2 * q + 2 * kv) + 3 * shape.hidden_size * shape.intermediate_size
    return shape.num_layers * per_layer + shape.vocab_size * shape.hidden_size


def decode_step_cost(shape: ModelShape, seq_lens: Sequence[int]) -> dict[str, float]:
    """Bytes read and FLOPs of one decode step over sequences of these lengths (the new token included)."""
    itemsize = shape.dtype.itemsize
    batch = len(seq_lens)
    norms = (2 * shape.num_layers + 1) * shape.hidden_size
    weight_bytes = (matmul_params(shape) + norms + batch * shape.hidden_size) * itemsize
    kv_lens = [min(n, w) if w is not None else n for w in shape.sliding_windows for n in seq_lens]
    kv_bytes = sum(kv_lens) * shape.num_kv_heads * shape.head_dim * 2 * itemsize
    attn_flops = 4 * sum(kv_lens) * shape.num_heads * shape.head_dim
    flops = 2 * matmul_params(shape) * batch + attn_flops
    return {"weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "bytes": weight_bytes + kv_bytes, "flops": flops}


def roofline_bound(cost: dict[str, float], bytes_per_s: float, flop_per_s: float) -> dict[str, float]:
    memory_s = cost["bytes"] / bytes_per_s
    compute_s = cost["flops"] / flop_per_s
    return {"memory_s": memory_s, "compute_s": compute_s, "bound_s": max(memory_s, compute_s)}


# ---- one traced generate ------------------------------------------------------------------------------------------
@attrs.frozen
class StepInfo:
    step_id: int
    num_tokens: int
    seq_lens: tuple[int, ...]
    is_decode: bool
    timings: StepTimings


class StepRecorder:
    """Keeps each step's plan shape and ``StepTimings``: the trace carries message times, not message contents."""

    def __init__(self, llm: LLM) -> None:
        self.runner = llm.engine.runner
        self._execute = self.runner.execute
        self.runner.execute = self._record
        self.steps: list[StepInfo] = []

    def _record(self, plan: StepPlan) -> tuple[dict[str, SampledToken], StepTimings, dict[str, PromptLogprobs]]:
        sampled, timings, prompt_logprobs = self._execute(plan)
        self.steps.append(StepInfo(plan.step_id, plan.num_tokens, tuple(r.seq_len for r in plan.rows),
                                   all(r.num_new_tokens == 1 for r in plan.rows), timings))
        return sampled, timings, prompt_logprobs


@attrs.frozen
class TracedRun:
    records: list[TraceRecord]
    steps: list[StepInfo]
    elapsed_s: float
    num_output_tokens: int


def traced_generate(llm: LLM, recorder: StepRecorder, prompts: list[list[int]], max_tokens: int) -> TracedRun:
    recorder.steps = []
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    num_out = sum(len(r.outputs[0].token_ids) for r in results)
    assert num_out == max_tokens * len(prompts), "ignore_eos: every request makes exactly max_tokens"
    trace = llm.last_trace
    assert trace.num_evicted == 0, "the trace ring dropped records: raise its capacity or shorten the run"
    return TracedRun(trace.records(), list(recorder.steps), elapsed, num_out)


def random_prompts(vocab_size: int, count: int, length: int, rng: random.Random) -> list[list[int]]:
    low = 256 if vocab_size > 1024 else 3  # skip special and byte tokens on a real vocabulary
    return [[rng.randrange(low, vocab_size) for _ in range(length)] for _ in range(count)]


def _by_type(records: list[TraceRecord], name: str) -> list[TraceRecord]:
    return [r for r in records if r.message_type == name]


def step_breakdowns(run: TracedRun) -> list[dict[str, Any]]:
    """Per step k that has a successor: its period (step k's start on the worker's thread to step k + 1's) cut
    along the critical path, that thread, so the parts add up to the period exactly: prepare, forward, sample, the
    rest of the runner's call, and the wait for the next plan. With one step in flight that wait holds the thread
    hops, the messages and the scheduler; with async scheduling they run beside the next forward pass, as the I/O
    actor's ``TokensOut`` handling always does: ``scheduler_s`` (its ``StepResult`` handling, the block exchange
    inside) and ``io_s`` are shown beside the parts."""
    results = _by_type(run.records, "StepResult")
    tokens_out = _by_type(run.records, "TokensOut")
    assert len(run.steps) == len(results), "one StepResult per step"
    out = []
    for k in range(len(run.steps) - 1):
        info, res = run.steps[k], results[k]
        t, nxt = info.timings, run.steps[k + 1].timings
        parts = {
            "prepare_s": t.prepare_s,
            "forward_s": t.forward_s,
            "sample_s": t.sample_s,
            "worker_other_s": (t.finished_at - t.started_at) - (t.prepare_s + t.forward_s + t.sample_s),
            "wait_for_plan_s": nxt.started_at - t.finished_at,
        }
        io_s = sum(r.handling_s for r in tokens_out if t.started_at <= r.started < nxt.started_at)
        # This step's tokens leave while the scheduler handles its StepResult (before or after the next plan).
        sent = [r.sent for r in tokens_out if r.sender == "scheduler" and res.started <= r.sent <= res.finished]
        out.append({"step_id": info.step_id, "is_decode": info.is_decode, "seq_lens": info.seq_lens,
                    "worker_step_s": t.finished_at - t.started_at, "period_s": nxt.started_at - t.started_at,
                    "parts": parts, "scheduler_s": res.handling_s, "io_s": io_s,
                    "tokens_out_sent": sent[0] if sent else None})
    return out


# ---- decode -------------------------------------------------------------------------------------------------------
def decode_bench(llm: LLM, recorder: StepRecorder, batch: int, context: int, num_tokens: int, skip_steps: int,
                 rng: random.Random) -> dict[str, Any]:
    """Times of the steady decode steps of one run; ``add_roofline`` sets them against the ceilings."""
    shape = llm.engine.shape
    prompts = random_prompts(shape.vocab_size, batch, context, rng)
    run = traced_generate(llm, recorder, prompts, num_tokens + 1)
    steady = [s for s in step_breakdowns(run) if s["is_decode"] and len(s["seq_lens"]) == batch][skip_steps:]
    assert steady, "no steady decode steps: raise decode_tokens"
    # The gap between consecutive steps' TokensOut: the step as a streaming client sees it.
    wall_gaps = [b["tokens_out_sent"] - a["tokens_out_sent"] for a, b in zip(steady, steady[1:], strict=False)
                 if a["tokens_out_sent"] is not None and b["tokens_out_sent"] is not None
                 and b["step_id"] == a["step_id"] + 1]
    return {
        "batch": batch,
        "context": context,
        "num_steady_steps": len(steady),
        "mean_seq_len": statistics.mean(statistics.mean(s["seq_lens"]) for s in steady),
        "forward_s": statistics.median(s["parts"]["forward_s"] for s in steady),
        "worker_step_s": statistics.median(s["worker_step_s"] for s in steady),
        "step_s": statistics.median(s["period_s"] for s in steady),
        "tokens_out_step_s": statistics.median(wall_gaps) if wall_gaps else None,
        "generate_s": run.elapsed_s,
        "steps": [{"seq_lens": list(s["seq_lens"]), "worker_step_s": s["worker_step_s"], "period_s": s["period_s"]}
                  for s in steady],
        "overhead": overhead_split(steady),
    }


def fastest_pass(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of one configuration with the lowest median step, with every run's median step beside it."""
    best = min(runs, key=lambda run: run["step_s"])
    return {**best, "passes_step_s": [run["step_s"] for run in runs], "pass_kept": runs.index(best)}


def add_roofline(result: dict[str, Any], shape: ModelShape, ceilings: dict[str, Any]) -> None:
    """Each step's bound from its own sequence lengths; medians of the bounds and of step/bound. Beside them the
    kernel bound: the weights at the streamed-matmul rate of this batch's rows, plus the KV at the read bandwidth."""
    bytes_per_s = ceilings["read_bandwidth"]["bytes_per_s"]
    flop_per_s = ceilings["matmul"]["flop_per_s"]
    stream_per_s = ceilings["streamed_matmul"][str(result["batch"])]["bytes_per_s"]
    steps = result["steps"]
    costs = [decode_step_cost(shape, s["seq_lens"]) for s in steps]
    bounds = [roofline_bound(c, bytes_per_s, flop_per_s) for c in costs]
    kernel_bound = [c["weight_bytes"] / stream_per_s + c["kv_bytes"] / bytes_per_s for c in costs]
    cost = costs[len(steps) // 2]
    bound = [b["bound_s"] for b in bounds]
    period = [s["period_s"] for s in steps]
    result.update({
        "bytes_per_step": cost["bytes"],
        "weight_bytes_per_step": cost["weight_bytes"],
        "kv_bytes_per_step": cost["kv_bytes"],
        "flops_per_step": cost["flops"],
        "memory_s": statistics.median(b["memory_s"] for b in bounds),
        "compute_s": statistics.median(b["compute_s"] for b in bounds),
        "bound_s": statistics.median(bound),
        "worker_ratio": statistics.median(s["worker_step_s"] / b for s, b in zip(steps, bound, strict=True)),
        "step_ratio": step_ratio(result, shape, ceilings),
        "kernel_bound_s": statistics.median(kernel_bound),
        "step_kernel_ratio": statistics.median(p / b for p, b in zip(period, kernel_bound, strict=True)),
    })
    # The issue's "at least 70% of the roofline" is "at most 1.4x the bound" inverted: the same median, not the
    # median of the inverses, which differs from it when a run has an even number of steps that spread widely.
    result["pct_of_roofline"] = 100 / result["step_ratio"]


def step_ratio(run: dict[str, Any], shape: ModelShape, ceilings: dict[str, Any]) -> float:
    """The median over a run's steps of step period / bound, against the given ceilings."""
    read, flop = ceilings["read_bandwidth"]["bytes_per_s"], ceilings["matmul"]["flop_per_s"]
    return statistics.median(s["period_s"] / roofline_bound(decode_step_cost(shape, s["seq_lens"]), read, flop)["bound_s"]
                             for s in run["steps"])


def paired_ratios(passes: list[list[dict[str, Any]]], ceiling_runs: list[dict[str, Any]],
                  shape: ModelShape) -> list[dict[str, Any]]:
    """Per configuration, each pass against the ceilings measured just before and just after it (the better of the
    two, the read ceiling raised to that pass's own fastest decode rate), rather than against the run's best: this
    VM's speed drifts by 20-40% within minutes, so a ceiling from a fast minute set against steps from a slow one
    (or the other way round) moves the ratio by as much as the code does. ``ceiling_runs[p]`` is the measurement
    before pass p, ``ceiling_runs[p + 1]`` the one after it."""
    assert len(ceiling_runs) == len(passes) + 1, "one ceiling measurement before each pass and one after the last"
    brackets = [raise_to_decode_rate(best_ceilings(ceiling_runs[p], ceiling_runs[p + 1]), runs, shape)
                for p, runs in enumerate(passes)]
    out = []
    for i in range(len(passes[0])):
        ratios = [step_ratio(runs[i], shape, bracket) for runs, bracket in zip(passes, brackets, strict=True)]
        out.append({"pass_ratios": ratios, "median": statistics.median(ratios),
                    "pass_read_bytes_per_s": [b["read_bandwidth"]["bytes_per_s"] for b in brackets],
                    "pass_flop_per_s": [b["matmul"]["flop_per_s"] for b in brackets]})
    return out


def overhead_split(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean seconds per part over the steps (means, so the parts add up to the mean period), and the shares."""
    period = statistics.mean(s["period_s"] for s in steps)
    parts = {name: statistics.mean(s["parts"][name] for s in steps) for name in steps[0]["parts"]}
    outside = period - parts["forward_s"]
    io = statistics.mean(s["io_s"] for s in steps)
    return {
        "period_s": period,
        "parts": parts,
        "scheduler_s": statistics.mean(s["scheduler_s"] for s in steps),
        "io_tokens_out_s": io,
        "outside_forward_s": outside,
        "outside_forward_pct": 100 * outside / period,
        "outside_forward_with_io_pct": 100 * (outside + io) / period,
    }


# ---- prefill ------------------------------------------------------------------------------------------------------
def prefill_bench(llm: LLM, recorder: StepRecorder, length: int, repeats: int,
                  rng: random.Random) -> dict[str, Any]:
    """One ``length``-token prompt through both engines, alternating run by run (the machine is shared: a
    neighbour then slows both sides alike), after one unmeasured run each; medians.

    Ksana: the prefill step of ``generate`` with ``max_tokens=1`` (from the worker taking its ``ExecuteStep`` to
    sending the ``StepResult``, in the trace; its forward from ``StepTimings``; the whole call beside them).
    ``transformers``: the forward of the same tokens with last-position logits only, what its ``generate`` asks for
    the first token.
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_model = AutoModelForCausalLM.from_pretrained(str(llm.engine.model_dir), dtype=llm.engine.dtype).eval()
    vocab = llm.engine.shape.vocab_size
    worker, forward, calls, hf_runs = [], [], [], []
    for i in range(repeats + 1):
        prompt = random_prompts(vocab, 1, length, rng)
        run = traced_generate(llm, recorder, prompt, 1)
        assert len(run.steps) == 1 and run.steps[0].num_tokens == length, "the prompt must prefill in one step"
        with torch.inference_mode():
            started = time.perf_counter()
            hf_model(input_ids=torch.tensor(prompt), logits_to_keep=1)
            hf_s = time.perf_counter() - started
        if i:  # the first round warms up
            # From the worker taking the ExecuteStep to its StepResult: thread hops, prepare, forward, sampling.
            worker.append(_by_type(run.records, "StepResult")[0].sent - _by_type(run.records, "ExecuteStep")[0].started)
            forward.append(run.steps[0].timings.forward_s)
            calls.append(run.elapsed_s)
            hf_runs.append(hf_s)
    del hf_model
    gc.collect()
    step, hf_step = statistics.median(worker), statistics.median(hf_runs)
    ksana = {"worker_step_s": step, "best_s": min(worker), "forward_s": statistics.median(forward),
             "generate_s": statistics.median(calls), "tok_s": length / step,
             "generate_tok_s": length / statistics.median(calls), "runs_s": worker}
    hf = {"forward_s": hf_step, "best_s": min(hf_runs), "tok_s": length / hf_step, "runs_s": hf_runs}
    return {"prompt_len": length, "ksana": ksana, "hf": hf, "ratio": ksana["tok_s"] / hf["tok_s"],
            "best_ratio": hf["best_s"] / ksana["best_s"]}


# ---- the run ------------------------------------------------------------------------------------------------------
def run_bench(settings: Settings) -> dict[str, Any]:
    rng = random.Random(0)
    torch.manual_seed(0)
    report: dict[str, Any] = {
        "model": settings.model,
        "settings": attrs.asdict(settings),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "host": platform.node(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "load_average_before": os.getloadavg()[0],  # the machine is shared: a busy one slows every figure
    }
    # Again after each decode pass; the best of each counts. On a thread of its own, like the engine's start-up, so
    # that this thread keeps no OpenMP pool to throttle the engine's forward thread (ksana/worker/fresh_thread.py).
    hidden_size = AutoConfig.from_pretrained(str(resolve_model_dir(settings.model))).hidden_size
    ceiling_runs = [run_in_fresh_thread(measure_ceilings, settings, hidden_size)]

    max_batch = max(settings.batches)
    max_len = max(max(settings.contexts) + settings.decode_tokens, settings.prefill_len) + 2
    step_tokens = max(max_batch * max(settings.contexts), settings.prefill_len)
    prefill: dict[str, Any] = {}
    for dtype_name in settings.prefill_dtypes:
        llm = LLM(model=settings.model, dtype=dtype_name, max_batch_size=max_batch, max_step_tokens=step_tokens,
                  max_token_len=max_len)
        recorder = StepRecorder(llm)
        if dtype_name == "float32":
            traced_generate(llm, recorder, random_prompts(llm.engine.shape.vocab_size, 2, 16, rng), 4)  # warm-up
            report["shape"] = {k: v for k, v in attrs.asdict(llm.engine.shape).items() if k != "dtype"}
            shape = llm.engine.shape
            configs = [(batch, context) for context in settings.contexts for batch in settings.batches]
            passes = []
            for _ in range(settings.decode_passes):  # the ceilings again after each pass: see paired_ratios
                passes.append([decode_bench(llm, recorder, batch, context, settings.decode_tokens,
                                            settings.skip_steps, rng) for batch, context in configs])
                ceiling_runs.append(run_in_fresh_thread(measure_ceilings, settings, hidden_size))
            decode = [fastest_pass([runs[i] for runs in passes]) for i in range(len(configs))]
            report["ceilings"] = ceilings = raise_to_decode_rate(best_ceilings(*ceiling_runs), decode, shape)
            report["ceiling_runs"] = ceiling_runs
            for d, paired in zip(decode, paired_ratios(passes, ceiling_runs, shape), strict=True):
                add_roofline(d, shape, ceilings)
                d["paired"] = paired
            report["decode"] = decode
            # The largest batch at the first context again with one step in flight: async scheduling's share.
            report["decode_one_in_flight"] = one = one_step_in_flight(
                llm, decode_bench, llm, recorder, max_batch, settings.contexts[0], settings.decode_tokens,
                settings.skip_steps, rng)
            add_roofline(one, shape, ceilings)
        prefill[dtype_name] = prefill_bench(llm, recorder, settings.prefill_len,
                                            settings.prefill_repeats[dtype_name], rng)
        del llm, recorder
        gc.collect()
    report["prefill"] = prefill
    if "ceilings" not in report:  # no float32 decode runs
        report["ceilings"] = best_ceilings(*ceiling_runs)
        report["ceiling_runs"] = ceiling_runs
    report["load_average_after"] = os.getloadavg()[0]
    report["overhead"] = {f"batch{d['batch']}_ctx{d['context']}": d["overhead"]
                          for d in report.get("decode", []) if d["batch"] == max_batch}
    if "decode_one_in_flight" in report:
        one = report["decode_one_in_flight"]
        report["overhead"][f"batch{one['batch']}_ctx{one['context']}_one_in_flight"] = one["overhead"]
    return report


def one_step_in_flight(llm: LLM, run: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """``run(*args)`` with async scheduling off (each generate call builds its scheduler actor from the setting)."""
    setting = llm.engine.scheduler.setting
    was, setting.async_scheduling = setting.async_scheduling, False
    try:
        return run(*args)
    finally:
        setting.async_scheduling = was


# ---- tables -------------------------------------------------------------------------------------------------------
OVERHEAD_ROWS = (
    ("forward_s", "forward (model + lm_head)"),
    ("prepare_s", "worker: build batch tensors"),
    ("sample_s", "worker: sampling"),
    ("worker_other_s", "worker: rest of the call"),
    ("wait_for_plan_s", "worker: waiting for the next plan"),
)


def format_report(report: dict[str, Any]) -> str:
    c = report["ceilings"]
    bw = c["read_bandwidth"]
    readers = ", ".join(f"{name} {v / 1e9:.1f}" for name, v in bw["by_reader_bytes_per_s"].items())
    lines = [
        f"model {report['model']}, torch {report['torch']}, {report['threads']} threads, load average "
        f"{report['load_average_before']:.1f} before, {report['load_average_after']:.1f} after",
        f"ceilings (best of {len(report['ceiling_runs'])} measurements): read {bw['bytes_per_s'] / 1e9:.1f} GB/s "
        f"({bw['bytes'] / 2**20:.0f} MiB: {readers}{_raised(bw)}), float32 matmul "
        f"{c['matmul']['flop_per_s'] / 1e9:.1f} GFLOP/s ({c['matmul']['n']}^3 GEMM: "
        + ", ".join(f"{name} {v / 1e9:.1f}" for name, v in c["matmul"]["by_kernel_flop_per_s"].items()) + ")",
        f"streamed matmul (the engine's projection kernel over one {bw['bytes'] / 2**20:.0f} MiB weight): "
        + ", ".join(f"{b} rows {m['bytes_per_s'] / 1e9:.1f} GB/s" for b, m in c["streamed_matmul"].items()),
        "",
        "decode, float32 (ms; medians over steady decode steps, the fastest of "
        f"{report['settings']['decode_passes']} passes; bound = max(mem, flop); kernel = weights at the "
        "streamed-matmul rate + KV at the read rate; paired: the median over passes of each pass's step/bound "
        "against the ceilings measured just before and after it)",
        f"{'batch':>5}{'ctx':>6}{'MB/step':>9}{'GFLOP':>7}{'mem':>7}{'flop':>7}{'bound':>7}{'fwd':>7}"
        f"{'worker':>8}{'step':>7}{'tok-out':>8}{'step/bound':>11}{'% roofline':>11}{'kernel':>8}{'step/kernel':>12}"
        f"{'paired':>8}  each pass",
    ]
    for d in report.get("decode", []):
        tok = d["tokens_out_step_s"]
        lines.append(
            f"{d['batch']:>5}{d['context']:>6}{d['bytes_per_step'] / 1e6:>9.1f}{d['flops_per_step'] / 1e9:>7.2f}"
            f"{d['memory_s'] * 1e3:>7.1f}{d['compute_s'] * 1e3:>7.1f}{d['bound_s'] * 1e3:>7.1f}"
            f"{d['forward_s'] * 1e3:>7.1f}{d['worker_step_s'] * 1e3:>8.1f}{d['step_s'] * 1e3:>7.1f}"
            f"{(tok or 0) * 1e3:>8.1f}{d['step_ratio']:>10.2f}x{d['pct_of_roofline']:>10.0f}%"
            f"{d['kernel_bound_s'] * 1e3:>8.1f}{d['step_kernel_ratio']:>11.2f}x"
            + (f"{d['paired']['median']:>7.2f}x  " + " / ".join(f"{r:.2f}" for r in d["paired"]["pass_ratios"])
               if "paired" in d else "")
        )
    lines += ["", f"prefill, one {next(iter(report['prefill'].values()))['prompt_len']}-token prompt "
              "(medians of alternating runs; best/best: the fastest run of each)",
              f"{'dtype':<10}{'ksana ms':>10}{'ksana tok/s':>13}{'generate tok/s':>16}{'hf ms':>9}"
              f"{'hf tok/s':>10}{'ksana/hf':>10}{'best/best':>11}"]
    for name, p in report["prefill"].items():
        k, h = p["ksana"], p["hf"]
        lines.append(f"{name:<10}{k['worker_step_s'] * 1e3:>10.1f}{k['tok_s']:>13.0f}{k['generate_tok_s']:>16.0f}"
                     f"{h['forward_s'] * 1e3:>9.1f}{h['tok_s']:>10.0f}{p['ratio']:>9.2f}x{p['best_ratio']:>10.2f}x")
    if report["overhead"]:
        keys = list(report["overhead"])
        lines += ["", "engine overhead per decode step (mean ms, % of the step period)",
                  f"{'part':<34}" + "".join(f"{k:>22}" for k in keys)]
        for part, label in OVERHEAD_ROWS:
            cells = "".join(_cell(o["parts"][part], o["period_s"]) for o in report["overhead"].values())
            lines.append(f"{label:<34}{cells}")
        rows = (("period_s", "= step period"), ("outside_forward_s", "outside the forward"))
        for key, label in rows:
            lines.append(f"{label:<34}" + "".join(_cell(o[key], o["period_s"]) for o in report["overhead"].values()))
        lines.append(f"{'beside: scheduler StepResult':<34}"
                     + "".join(_cell(o["scheduler_s"], o["period_s"]) for o in report["overhead"].values()))
        lines.append(f"{'beside: I/O TokensOut':<34}"
                     + "".join(_cell(o["io_tokens_out_s"], o["period_s"]) for o in report["overhead"].values()))
        lines.append(f"{'outside forward + I/O':<34}"
                     + "".join(f"{o['outside_forward_with_io_pct']:>21.1f}%" for o in report["overhead"].values()))
    return "\n".join(lines)


def _raised(read: dict[str, Any]) -> str:
    if read.get("source", "measured") == "measured":
        return ""
    return f"; raised from {read['measured_bytes_per_s'] / 1e9:.1f} to the rate of {read['source']}"


def _cell(seconds: float, period: float) -> str:
    return f"{seconds * 1e3:>13.2f} ({100 * seconds / period:>5.1f}%)"


def write_report(report: dict[str, Any], out: Path) -> None:
    """The report as JSON, numbers allowed as keys (orjson refuses them unless told)."""
    write_json(report, out, options=orjson.OPT_NON_STR_KEYS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the demo model, small shapes: checks the script")
    parser.add_argument("--model", help="override the model (default smollm2; demo with --quick)")
    parser.add_argument("--decode-tokens", type=int, help="decode steps per run")
    parser.add_argument("--out", help="result JSON (default bench/results/roofline_<machine kind>.json, "
                                      "roofline_quick.json with --quick)")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else Settings()
    if args.model:
        settings = attrs.evolve(settings, model=args.model)
    if args.decode_tokens:
        settings = attrs.evolve(settings, decode_tokens=args.decode_tokens)
    resolve_model_dir(settings.model)  # fail early on an unknown model
    report = run_bench(settings)
    print(format_report(report))
    print()
    write_report(report, Path(args.out) if args.out else default_out(RESULTS, "roofline", quick=args.quick))
    return 0


if __name__ == "__main__":
    sys.exit(main())
