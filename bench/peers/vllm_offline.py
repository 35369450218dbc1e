"""vLLM's offline ``LLM.generate`` on a workload file: the peer side of ``bench/vs_vllm.py``'s offline comparison.

Runs with the peer venv's python (``bench/peers/setup_vllm_cpu.sh``), never with Ksana's. The workload file holds
``{"prompts": [[token ids], ...], "outputs": [max_tokens, ...]}``; every request is greedy with ``ignore_eos``,
so it produces exactly its ``max_tokens``. vLLM runs at its defaults, as its users start it. One warm-up request,
then ``--passes`` timed passes of the whole workload on the same engine; the result goes to ``--out`` as JSON (each
pass's seconds, the best pass's tokens/s, the engine's start-up time), not to stdout, where vLLM logs.

    bench/peers/.venv-vllm/bin/python bench/peers/vllm_offline.py MODEL_DIR WORKLOAD.json --out RESULT.json
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir")
    parser.add_argument("workload", help="JSON with prompts (token ids) and outputs (tokens per request)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--out", required=True, help="where the result JSON goes")
    args = parser.parse_args()
    with open(args.workload) as f:
        workload = json.load(f)
    prompts, outputs = workload["prompts"], workload["outputs"]

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm = LLM(model=args.model_dir, dtype=args.dtype, seed=0)
    load_s = time.perf_counter() - started
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0])],
                 SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outputs]
    pass_s = []
    for _ in range(args.passes):
        started = time.perf_counter()
        results = llm.generate(requests, params, use_tqdm=False)
        pass_s.append(time.perf_counter() - started)
        num_out = sum(len(r.outputs[0].token_ids) for r in results)
        assert num_out == sum(outputs), f"vLLM produced {num_out} tokens, the workload asks for {sum(outputs)}"
    best = min(pass_s)
    with open(args.out, "w") as f:
        json.dump({"seconds": best, "pass_seconds": pass_s, "output_tokens": num_out, "output_tok_s": num_out / best,
                   "load_seconds": load_s}, f)


if __name__ == "__main__":
    main()
