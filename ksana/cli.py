"""The ``ksana`` command. Subcommands: ``demo-model`` (write the tiny test model) and ``generate`` (offline)."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from ksana.config import ConfigError


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model directory, or a built-in name: smollm2 (default), demo")
    parser.add_argument("--config", help="runtime YAML (setting.* / model_spec.* keys)")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--max-batch-size", type=int)
    parser.add_argument("--max-step-tokens", type=int)
    parser.add_argument("--block-token-num", type=int)
    parser.add_argument("--split-fuse-token-num", type=int)
    parser.add_argument("--num-device-blocks", type=int)
    parser.add_argument("--enable-prefix-caching", action="store_true", default=None,
                        dest="enable_auto_prefix_cache", help="setting.batch_scheduler.enable_auto_prefix_cache")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="plan the next step while one runs (setting.batch_scheduler.async_scheduling, "
                             "default on)")


def config_overrides(args: argparse.Namespace) -> dict:
    keys = ("dtype", "max_batch_size", "max_step_tokens", "block_token_num", "split_fuse_token_num",
            "num_device_blocks", "enable_auto_prefix_cache", "async_scheduling")
    return {key: getattr(args, key) for key in keys}


def _cmd_demo_model(args: argparse.Namespace) -> int:
    from ksana.builtin.demo import write_demo_model

    path = write_demo_model(args.out, family=args.family)
    print(path)
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from ksana.llm import LLM
    from ksana.sampling_params import SamplingParams

    llm = LLM(model=args.model, config=args.config, **config_overrides(args))
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    started = time.perf_counter()
    if args.chat:
        outputs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        outputs = llm.generate([args.prompt], params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    completion = outputs[0].outputs[0]
    print(completion.text.strip())
    print(f"[{len(completion.token_ids)} tokens in {elapsed:.2f} s: {len(completion.token_ids) / elapsed:.1f} tokens/s, "
          f"finish_reason={completion.finish_reason}]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ksana", description="Ksana LLM inference engine")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo-model", help="write the tiny random-weight demo model directory")
    demo.add_argument("--out", required=True, help="output directory")
    demo.add_argument("--family", choices=["qwen2", "llama"], default="qwen2")
    demo.set_defaults(func=_cmd_demo_model)

    gen = sub.add_parser("generate", help="generate offline for one prompt and print the answer")
    _add_config_flags(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int)
    gen.set_defaults(func=_cmd_generate)

    from ksana.perf.cli import add_perf_parser
    from ksana.server.cli import add_serve_parser

    add_serve_parser(sub, _add_config_flags)
    add_perf_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"ksana: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
