"""Prefix cache benchmark: 64 requests sharing a 1,024-token system prompt, each with its own 64-token suffix.

Cache on vs off: mean/p50 TTFT, wall time and output throughput. Then the overhead at a 0% hit rate: 64 distinct
prompts of the same shape, cache on vs off, alternating runs, median of ``--repeats`` each (vLLM reports < 1%;
the project's target is < 2%). Prints a table and writes ``bench/results/prefix_cache_<machine kind>.json``
(``prefix_cache_quick.json`` with ``--quick``).

    python bench/prefix_cache.py                  # the built-in demo model, float32
    python bench/prefix_cache.py --model smollm2   # a real model (slow on CPU)
    python bench/prefix_cache.py --quick          # 16 requests, 256-token system prompt
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time
from pathlib import Path

import trio

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from ksana.bench.results import default_out, write_json  # noqa: E402
from ksana.config import load_config  # noqa: E402
from ksana.engine import InferenceEngine  # noqa: E402
from ksana.events import Actor, handles  # noqa: E402
from ksana.messages import AddRequests, TokensOut  # noqa: E402
from ksana.request import InferRequest  # noqa: E402
from ksana.sampling_params import SamplingParams  # noqa: E402

RESULTS = Path(__file__).parent / "results"


class TimingIO(Actor):
    """Records each request's first-token time and its output count."""

    name = "io"

    def __init__(self, num_requests: int) -> None:
        self.first_token: dict[str, float] = {}
        self.num_tokens = 0
        self.num_open = num_requests
        self.done = trio.Event()

    @handles(TokensOut)
    async def on_tokens(self, msg: TokensOut) -> None:
        now = time.perf_counter()
        for delta in msg.deltas:
            if delta.new_token_ids:
                self.first_token.setdefault(delta.request_id, now)
                self.num_tokens += len(delta.new_token_ids)
            if delta.finish_reason is not None:
                self.num_open -= 1
        if self.num_open == 0:
            self.done.set()


def make_prompts(rng: random.Random, vocab: int, num: int, system_len: int, suffix_len: int,
                 shared: bool) -> list[list[int]]:
    system = [rng.randrange(3, vocab) for _ in range(system_len)]
    prompts = []
    for _ in range(num):
        head = system if shared else [rng.randrange(3, vocab) for _ in range(system_len)]
        prompts.append(head + [rng.randrange(3, vocab) for _ in range(suffix_len)])
    return prompts


def run(engine: InferenceEngine, prompts: list[list[int]], max_tokens: int, tag: str) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    requests = [InferRequest(request_id=f"{tag}-{i}", prompt_token_ids=p, sampling_params=params, seed=i)
                for i, p in enumerate(prompts)]
    io = TimingIO(len(requests))

    async def main() -> float:
        loop = engine.build_loop(io)
        async with loop.running():
            started = time.perf_counter()
            await loop.send(AddRequests(tuple(requests)), sender="bench")
            await io.done.wait()
            return started

    started = trio.run(main)
    elapsed = time.perf_counter() - started
    ttfts = sorted(t - started for t in io.first_token.values())
    return {"seconds": elapsed, "output_tokens": io.num_tokens, "output_tok_s": io.num_tokens / elapsed,
            "ttft_mean_s": statistics.mean(ttfts), "ttft_p50_s": ttfts[len(ttfts) // 2]}


def engine_for(model: str, prefix_cache: bool, num_blocks: int) -> InferenceEngine:
    config = load_config(None, model_dir=model, dtype="float32", enable_auto_prefix_cache=prefix_cache,
                         max_batch_size=64, max_step_tokens=2048, split_fuse_token_num=512,
                         num_device_blocks=num_blocks, block_token_num=16)
    return InferenceEngine(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--quick", action="store_true", help="16 requests, 256-token system prompt")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--out", help="result JSON (default bench/results/prefix_cache_<machine kind>.json, "
                                      "prefix_cache_quick.json with --quick)")
    args = parser.parse_args()
    num, system_len, suffix_len = (16, 256, 64) if args.quick else (64, 1024, 64)
    num_blocks = num * (-(-(system_len + suffix_len + args.max_tokens) // 16)) + 16
    engines = {on: engine_for(args.model, on, num_blocks) for on in (False, True)}
    vocab = engines[False].shape.vocab_size
    rng = random.Random(0)
    shared = make_prompts(rng, vocab, num, system_len, suffix_len, shared=True)
    warm = make_prompts(rng, vocab, 4, 32, 8, shared=False)
    for engine in engines.values():
        run(engine, warm, 4, "warm")

    rows = {}
    for on, engine in engines.items():
        rows[f"shared prefix, cache {'on' if on else 'off'}"] = run(engine, shared, args.max_tokens, f"s{on}")
    # 0% hit rate: fresh distinct prompts for every run, so the cache on never hits; alternate on/off runs.
    overhead_runs: dict[bool, list[float]] = {False: [], True: []}
    for r in range(args.repeats):
        for on in (False, True) if r % 2 == 0 else (True, False):
            distinct = make_prompts(random.Random(100 + 2 * r + on), vocab, num, system_len, suffix_len, shared=False)
            overhead_runs[on].append(run(engines[on], distinct, args.max_tokens, f"d{r}{on}")["seconds"])
    hit_tokens = engines[True].cache_manager.stats.prefix_cache_hit_token_num
    assert hit_tokens > 0, "the shared-prefix run must hit"
    off, on = statistics.median(overhead_runs[False]), statistics.median(overhead_runs[True])
    overhead = on / off - 1.0

    print(f"{'run':<28}{'wall s':>9}{'out tok/s':>11}{'TTFT mean s':>13}{'TTFT p50 s':>12}")
    for name, row in rows.items():
        print(f"{name:<28}{row['seconds']:>9.2f}{row['output_tok_s']:>11.1f}{row['ttft_mean_s']:>13.3f}"
              f"{row['ttft_p50_s']:>12.3f}")
    print(f"prefix_cache_hit_token_num (cache on, shared run): {hit_tokens} of {num * (system_len + suffix_len)}")
    print(f"0% hit rate: cache off {off:.3f} s, cache on {on:.3f} s (median of {args.repeats}): "
          f"overhead {overhead * 100:+.2f}%")
    out = {"model": args.model, "num_requests": num, "system_prompt_tokens": system_len, "suffix_tokens": suffix_len,
           "max_tokens": args.max_tokens, "runs": rows, "zero_hit_seconds": {"off": overhead_runs[False],
                                                                              "on": overhead_runs[True]},
           "zero_hit_overhead": overhead, "prefix_cache_hit_token_num": hit_tokens, "platform": platform.platform(),
           "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    write_json(out, args.out or default_out(RESULTS, "prefix_cache", quick=args.quick))


if __name__ == "__main__":
    main()
