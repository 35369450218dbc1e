"""Tensor-parallel overhead: offline greedy throughput at TP=N against TP=1, same model, prompts and settings.

On one 2-core CPU machine the ranks share the same cores, so TP cannot gain; the figure shows what the collectives
(two all-reduces per layer, the embedding all-reduce and the lm_head gather over gloo) and the plan broadcast cost.
SmolLM2-135M has 3 KV heads, so its only valid sizes are 1 and 3; the demo model (2 KV heads) runs TP=2.

    python bench/tp.py                           # smollm2 at TP=3 and the demo model at TP=2, each vs TP=1
    python bench/tp.py --runs smollm2:3 --quick  # a smaller run to check the script
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from ksana import LLM, SamplingParams  # noqa: E402
from ksana.bench.results import default_out, write_json  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def measure(model: str, tp: int, prompts: list[list[int]], max_tokens: int) -> dict:
    started = time.perf_counter()
    llm = LLM(model=model, tensor_para_size=tp)
    load_s = time.perf_counter() - started
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    started = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    llm.engine.close()
    num_out = sum(len(r.outputs[0].token_ids) for r in results)
    return {"model": model, "tensor_para_size": tp, "load_s": round(load_s, 2), "elapsed_s": round(elapsed, 3),
            "num_output_tokens": num_out, "output_tokens_per_s": round(num_out / elapsed, 1),
            "tokens": [r.outputs[0].token_ids for r in results]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", default=["smollm2:3", "demo:2"], help="MODEL:TP pairs")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="4 prompts of 16 tokens, 8 new tokens")
    parser.add_argument("--out", help="result JSON (default bench/results/tp_<machine kind>.json, tp_quick.json "
                                      "with --quick)")
    args = parser.parse_args()
    if args.quick:
        args.num_prompts, args.prompt_len, args.max_tokens = 4, 16, 8
    rng = random.Random(0)
    rows = []
    for run in args.runs:
        model, tp = run.rsplit(":", 1)
        vocab = LLM(model=model).engine.shape.vocab_size if model != "smollm2" else 49152
        prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
        base = measure(model, 1, prompts, args.max_tokens)
        parallel = measure(model, int(tp), prompts, args.max_tokens)
        same = base.pop("tokens") == parallel.pop("tokens")
        parallel["speedup_vs_tp1"] = round(parallel["output_tokens_per_s"] / base["output_tokens_per_s"], 3)
        parallel["greedy_tokens_equal_tp1"] = same
        rows += [base, parallel]

    print(f"{'model':<10} {'TP':>3} {'load s':>7} {'gen s':>7} {'out tok':>8} {'tok/s':>8} {'vs TP1':>7} {'same':>5}")
    for r in rows:
        print(f"{r['model']:<10} {r['tensor_para_size']:>3} {r['load_s']:>7.2f} {r['elapsed_s']:>7.2f} "
              f"{r['num_output_tokens']:>8} {r['output_tokens_per_s']:>8.1f} {r.get('speedup_vs_tp1', 1.0):>7.3f} "
              f"{str(r.get('greedy_tokens_equal_tp1', '')):>5}")
    report = {"platform": platform.platform(), "threads_tp1": torch.get_num_threads(),
              "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "workload": {"num_prompts": args.num_prompts, "prompt_len": args.prompt_len,
                           "max_tokens": args.max_tokens, "greedy": True},
              "results": rows}
    write_json(report, args.out or default_out(RESULTS, "tp", quick=args.quick))
    return 0


if __name__ == "__main__":
    sys.exit(main())
