"""Speculative decoding on and off: tokens per main-model step, output throughput and acceptance by position.

Two workloads, each greedy with ``ignore_eos`` so both runs produce the same tokens (speculation is lossless):
``bench`` is ``bench/throughput.py``'s (random prompt tokens: little for prompt lookup to find) and
``repetitive`` is text that quotes itself (lists, tables, code with repeated shapes: what prompt lookup is for).
Each runs at batch 1 (requests one after another) and batch 16 (or ``--batches``), without speculation and with
it, in one process. ``--batches 1,4,8,16`` shows where drafting stops paying, which is where
``spec_max_batch_size``'s default comes from; the runs here set it to 0 (draft at every batch size).

    python bench/speculative.py                  # smollm2, prompt lookup with 4 drafts per step
    python bench/speculative.py --drafts 2 --batches 1,4,8,16
    python bench/speculative.py --quick          # the demo model, a few short requests: checks the script

A full run writes ``bench/results/speculative_<machine kind>.json``, a ``--quick`` one ``speculative_quick.json``.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from throughput import make_workload  # noqa: E402

from ksana import LLM, SamplingParams  # noqa: E402
from ksana.bench.results import default_out, write_json  # noqa: E402
from ksana.builtin import resolve_model_dir  # noqa: E402
from ksana.tokenizer import load_tokenizer  # noqa: E402

RESULTS = Path(__file__).parent / "results"
ITEMS = ["apple", "pear", "plum", "fig", "kiwi", "lime", "date", "peach", "grape", "melon", "cherry", "mango"]


def repetitive_prompts(num: int, seed: int = 0) -> list[str]:
    """Prompts whose continuation repeats what they already hold, of four shapes."""
    rng = random.Random(seed)
    prompts = []
    for i in range(num):
        items = rng.sample(ITEMS, 4)
        shape = i % 4
        if shape == 0:
            prompts.append("".join(f"<li>{item}</li>\n" for item in items * 2))
        elif shape == 1:
            rows = "".join(f"| {item} | {len(item)} | {item.upper()} |\n" for item in items)
            prompts.append(f"| name | length | upper |\n|---|---|---|\n{rows}{rows}")
        elif shape == 2:
            prompts.append("".join(f"def get_{item}(self):\n    return self.{item}\n\n" for item in items))
        else:
            prompts.append(", ".join(items * 3) + ",")
    return prompts


def run(model: str, prompts, outputs: list[int], batch: int, drafts: int) -> dict[str, Any]:
    llm = LLM(model=model, max_batch_size=batch, ngram_step_num=drafts, spec_max_batch_size=0)
    llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outputs]
    steps_before, spec_before = llm.engine.scheduler.stats.num_steps, llm.spec_decoding_stats
    started = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    llm.engine.close()
    spec = llm.spec_decoding_stats
    for name in ("num_verify_rows", "spec_draft_token_num", "spec_draft_hit_num"):
        setattr(spec, name, getattr(spec, name) - getattr(spec_before, name))
    spec.draft_tokens_by_position = [n - (spec_before.draft_tokens_by_position[i:i + 1] or [0])[0]
                                     for i, n in enumerate(spec.draft_tokens_by_position)]
    spec.hits_by_position = [n - (spec_before.hits_by_position[i:i + 1] or [0])[0]
                             for i, n in enumerate(spec.hits_by_position)]
    num_steps = llm.engine.scheduler.stats.num_steps - steps_before
    num_out = sum(len(r.outputs[0].token_ids) for r in results)
    return {"seconds": round(elapsed, 3), "output_tokens": num_out, "num_steps": num_steps,
            "tokens_per_step": round(num_out / num_steps, 3), "output_tok_s": round(num_out / elapsed, 2),
            "token_ids": [r.outputs[0].token_ids for r in results], **spec.to_dict()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--drafts", type=int, default=4, help="prompt-lookup drafts per step")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batches", default="1,16", help="batch sizes, comma-separated (default 1,16)")
    parser.add_argument("--quick", action="store_true", help="the demo model, 4 requests of 16 tokens")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    model = "demo" if args.quick else args.model
    num = 4 if args.quick else 16
    output_len = 16 if args.quick else args.output_len
    vocab = len(load_tokenizer(resolve_model_dir(model)))
    bench_prompts, _ = make_workload(vocab, num, (32, 256), (output_len, output_len), seed=0)
    workloads = {"bench": bench_prompts, "repetitive": repetitive_prompts(num)}
    # Batch size -> requests: batch 1 runs fewer, one after another.
    batches = {int(b): max(1, num // 4) if int(b) == 1 else num for b in args.batches.split(",")}

    report: dict[str, Any] = {"model": model, "drafter": "ngram", "num_draft_tokens": args.drafts,
                              "output_len": output_len, "runs": {}}
    print(f"{'workload':<11} {'batch':>5} {'spec':>5} {'tok/s':>8} {'tok/step':>8} {'accepted':>8} "
          f"{'mean len':>8}  by position")
    for name, prompts in workloads.items():
        for batch, num_requests in batches.items():
            pair = {}
            for drafts in (0, args.drafts):
                result = run(model, prompts[:num_requests], [output_len] * num_requests, batch, drafts)
                pair["on" if drafts else "off"] = result
                print(f"{name:<11} {batch:>5} {'on' if drafts else 'off':>5} {result['output_tok_s']:>8.1f} "
                      f"{result['tokens_per_step']:>8.2f} {result['acceptance_rate']:>8.1%} "
                      f"{result['mean_accepted_length']:>8.2f}  {result['acceptance_by_position']}", flush=True)
            if pair["on"].pop("token_ids") != pair["off"].pop("token_ids"):
                raise SystemExit(f"{name}, batch {batch}: speculation changed the greedy output")
            pair["speedup"] = round(pair["on"]["output_tok_s"] / pair["off"]["output_tok_s"], 3)
            report["runs"].setdefault(name, {})[str(batch)] = pair
    write_json(report, args.out or default_out(RESULTS, "speculative", quick=args.quick))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
