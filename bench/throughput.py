"""Offline throughput: Ksana against Hugging Face ``transformers`` ``generate`` on the same model and prompts.

``transformers`` runs the way its users write it: static, left-padded batches (of 32 and of 64 prompts by
default), each batch generating until its longest request is done; the fastest is the baseline. Ksana gets all
prompts at once and batches continuously. Output tokens/s counts each prompt's own requested tokens
(``ignore_eos``), so padding and overshoot are the baseline's cost, as they are for its users.

    python bench/throughput.py                 # smollm2: 64 prompts (32-256 in, 64-512 out), float32 and bfloat16
    python bench/throughput.py --quick         # the demo model, 8 short prompts: checks the script
    python bench/throughput.py --dtypes float32 --hf-batch-sizes 8,32,64
    python bench/throughput.py --dtypes bfloat16 --hf-batch-sizes 32 --hf-batches 1   # transformers' first batch

A full run writes ``bench/results/throughput_<machine kind>.json``, a ``--quick`` one ``throughput_quick.json``.

``--hf-batches N`` runs ``transformers`` on its first N static batches only and counts the tokens/s over them:
each static batch is an independent ``generate``, so its rate is the baseline's rate at that batch size, and on
a CPU without bfloat16 arithmetic ``transformers`` in bfloat16 needs about 40 minutes for the whole workload.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from ksana import LLM, SamplingParams  # noqa: E402
from ksana.bench.results import default_out, write_json  # noqa: E402
from ksana.builtin import resolve_model_dir  # noqa: E402

RESULTS = Path(__file__).parent / "results"
# The workload: prompt and output lengths drawn uniformly from these ranges (also vs_vllm.py's offline comparison).
WORKLOAD = {"num_prompts": 64, "input_range": (32, 256), "output_range": (64, 512)}
QUICK_WORKLOAD = {"num_prompts": 8, "input_range": (16, 32), "output_range": (4, 16)}


def make_workload(vocab_size: int, num_prompts: int, input_range, output_range, seed: int = 0):
    """Random-token prompts (seeded) and each one's output length."""
    rng = random.Random(seed)
    low = 256 if vocab_size > 1024 else 3  # skip special and byte tokens on a real vocabulary
    prompts = [[rng.randrange(low, vocab_size) for _ in range(rng.randint(*input_range))] for _ in range(num_prompts)]
    outputs = [rng.randint(*output_range) for _ in range(num_prompts)]
    return prompts, outputs


def run_ksana(model: str, dtype: str, prompts, outputs, passes: int = 1) -> dict:
    """``passes`` timed passes of the whole workload on one engine after a warm-up request; the best counts."""
    llm = LLM(model=model, dtype=dtype, max_batch_size=64, max_step_tokens=2048, split_fuse_token_num=512)
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([prompts[0]], warm, use_tqdm=False)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outputs]
    pass_s = []
    for _ in range(passes):
        started = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        pass_s.append(time.perf_counter() - started)
        num_out = sum(len(r.outputs[0].token_ids) for r in results)
        assert num_out == sum(outputs), "every request must produce exactly its requested tokens"
    llm.engine.close()  # its forward thread and that thread's OpenMP pool end here (see run_all)
    best = min(pass_s)
    return {"seconds": best, "pass_seconds": pass_s, "output_tokens": num_out, "output_tok_s": num_out / best}


def run_hf(model_dir: Path, dtype: torch.dtype, prompts, outputs, batch_size: int,
           max_batches: int | None = None) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    model.generate(torch.tensor([prompts[0][:8]]), max_new_tokens=2, do_sample=False, pad_token_id=pad_id)
    if max_batches is not None:  # the first static batches only (see the module docstring)
        prompts, outputs = prompts[: max_batches * batch_size], outputs[: max_batches * batch_size]
    started = time.perf_counter()
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start:start + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        new = max(outputs[start:start + batch_size])
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=pad_id)
    elapsed = time.perf_counter() - started
    num_out = sum(outputs)
    return {"seconds": elapsed, "output_tokens": num_out, "output_tok_s": num_out / elapsed, "batch_size": batch_size,
            "num_prompts": len(prompts)}


def run_all(model: str, dtype_names: list[str], prompts, outputs, hf_batch_sizes,
            hf_batches: int | None = None) -> dict[str, dict]:
    """Every Ksana run first, then every ``transformers`` run on this (main) thread, as its users run it.

    The order matters on a small CPU: libgomp keeps an OpenMP pool for each thread that ran a parallel region and
    throttles them all once they outnumber the CPUs (see ksana/worker/fresh_thread.py), so a Ksana run after
    ``transformers`` had run here would be slowed by this thread's pool. Each Ksana run closes its engine, whose
    forward thread ends with its pool, so the ``transformers`` runs have the CPUs' pools to themselves."""
    ksana = {}
    for dtype_name in dtype_names:
        print(f"{dtype_name}: ksana ...", flush=True)
        ksana[dtype_name] = run_ksana(model, dtype_name, prompts, outputs)
        print(f"{dtype_name}: ksana {ksana[dtype_name]['output_tok_s']:.1f} tok/s", flush=True)
    report = {}
    for dtype_name in dtype_names:
        hf = {}
        for bs in hf_batch_sizes:
            hf[f"hf_batch_{bs}"] = run_hf(resolve_model_dir(model), getattr(torch, dtype_name), prompts, outputs, bs,
                                          hf_batches)
            print(f"{dtype_name}: transformers batch {bs} {hf[f'hf_batch_{bs}']['output_tok_s']:.1f} tok/s",
                  flush=True)
        baseline = max(hf.values(), key=lambda r: r["output_tok_s"])
        report[dtype_name] = {
            "num_prompts": len(prompts),
            "input_tokens": sum(len(p) for p in prompts),
            "output_tokens": sum(outputs),
            "ksana": ksana[dtype_name],
            **hf,
            "ksana_output_tok_s": ksana[dtype_name]["output_tok_s"],
            "hf_output_tok_s": baseline["output_tok_s"],
            "hf_baseline": f"batch {baseline['batch_size']}",
            "ratio": ksana[dtype_name]["output_tok_s"] / baseline["output_tok_s"],
        }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="default smollm2 (demo with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="the demo model, 8 short prompts, transformers at batch 8 only: checks the script")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--hf-batch-sizes", help="transformers' static batch sizes to try (default 32,64; 8 with "
                                                 "--quick)")
    parser.add_argument("--hf-batches", type=int, default=None,
                        help="run transformers on its first N static batches only (default: the whole workload)")
    parser.add_argument("--out", help="result JSON (default bench/results/throughput_<machine kind>.json, "
                                      "throughput_quick.json with --quick)")
    args = parser.parse_args()
    if args.hf_batches is not None and args.hf_batches < 1:
        parser.error(f"--hf-batches must be at least 1, got {args.hf_batches}")
    args.model = args.model or ("demo" if args.quick else "smollm2")
    torch.manual_seed(0)

    from ksana.tokenizer import load_tokenizer

    vocab = len(load_tokenizer(resolve_model_dir(args.model)))
    prompts, outputs = make_workload(vocab, **(QUICK_WORKLOAD if args.quick else WORKLOAD))
    hf_batch_sizes = [int(b) for b in (args.hf_batch_sizes or ("8" if args.quick else "32,64")).split(",")]

    report = {
        "model": args.model,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "host": platform.node(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    report["hf_batches"] = args.hf_batches
    report |= run_all(args.model, args.dtypes.split(","), prompts, outputs, hf_batch_sizes, args.hf_batches)

    hf_columns = "".join(f"{f'hf b{bs} tok/s':>15}" for bs in hf_batch_sizes)
    print(f"\n{'dtype':<10}{'prompts':>8}{'out tok':>9}{'ksana tok/s':>13}{hf_columns}{'ratio':>8}")
    for dtype_name in args.dtypes.split(","):
        r = report[dtype_name]
        hf_values = "".join(f"{r[f'hf_batch_{bs}']['output_tok_s']:>15.1f}" for bs in hf_batch_sizes)
        print(f"{dtype_name:<10}{r['num_prompts']:>8}{r['output_tokens']:>9}{r['ksana_output_tok_s']:>13.1f}"
              f"{hf_values}{r['ratio']:>7.2f}x")
    if args.hf_batches is not None:
        print(f"(transformers ran its first {args.hf_batches} static batch(es) at each size only: --hf-batches)")
    print()
    write_json(report, args.out or default_out(RESULTS, "throughput", quick=args.quick))


if __name__ == "__main__":
    main()
