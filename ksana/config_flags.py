"""The command-line flags every engine command shares (``generate``, ``serve``, ``simulate``, ...), and the
configuration overrides they make: each names a leaf key of the runtime YAML."""

from __future__ import annotations

import argparse


def add_config_flags(parser: argparse.ArgumentParser) -> None:
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
                             "default on; off while speculative decoding is on)")
    parser.add_argument("--ngram-step-num", type=int, metavar="K",
                        help="speculative decoding by prompt lookup: K draft tokens per step (0: off)")
    parser.add_argument("--prompt-lookup-min", type=int, metavar="N", help="shortest suffix prompt lookup matches")
    parser.add_argument("--prompt-lookup-max", type=int, metavar="N", help="longest suffix prompt lookup matches")
    parser.add_argument("--spec-max-batch-size", type=int, metavar="N",
                        help="draft only while at most N requests run (0: at any batch size)")
    parser.add_argument("--mtp-step-num", type=int, metavar="K",
                        help="speculative decoding by the model's MTP modules: K draft tokens per step (0: off)")


def config_overrides(args: argparse.Namespace) -> dict:
    keys = ("dtype", "max_batch_size", "max_step_tokens", "block_token_num", "split_fuse_token_num",
            "num_device_blocks", "enable_auto_prefix_cache", "async_scheduling", "ngram_step_num",
            "prompt_lookup_min", "prompt_lookup_max", "spec_max_batch_size", "mtp_step_num")
    return {key: getattr(args, key) for key in keys}
