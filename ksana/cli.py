"""The ``ksana`` command: ``demo-model`` (write the tiny test model) and ``generate`` (offline) live here; ``serve``
and ``bench serve`` come from ``ksana.server.cli``, ``router`` from ``ksana.router.cli``; perf mode and the
simulator plug theirs in through the ``ksana.commands`` entry points (``pyproject.toml``), so the engine never
imports the layers built on it.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from importlib.metadata import entry_points

from ksana.config import ConfigError
from ksana.config_flags import add_config_flags, config_overrides


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
    add_config_flags(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int)
    gen.set_defaults(func=_cmd_generate)

    from ksana.router.cli import add_router_parser
    from ksana.server.cli import add_serve_parser

    add_serve_parser(sub)
    add_router_parser(sub)
    for command in sorted(entry_points(group="ksana.commands"), key=lambda point: point.name):
        command.load()(sub)
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
