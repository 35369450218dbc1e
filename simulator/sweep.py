"""A profiling sweep: a ``batch_config.json`` whose batches cover the steps serving produces, for ``ksana perf``.

Serving makes four kinds of step, and the sweep profiles each across its range: whole prompts (one or several),
prefill chunks over a cached prefix (chunked prefill, prefix-cache hits), decode batches from one row to
``max_batch_size`` at short and long contexts, and mixed steps (a chunk beside decode rows, what continuous
batching does most under load). Every batch fits one step under the given limits.
"""

from __future__ import annotations

from pathlib import Path

import orjson

Entry = dict[str, int]


def _powers(low: int, high: int) -> list[int]:
    values, v = [], low
    while v <= high:
        values.append(v)
        v *= 2
    if values and values[-1] != high and high > low:
        values.append(high)
    return values


def sweep_batches(max_batch_size: int, max_step_tokens: int, split_fuse_token_num: int = 0,
                  max_context: int = 2048) -> list[list[Entry]]:
    """Each batch as KsanaLLM's ``dp_0`` list of ``{forwarding_token_num, sequence_len, request_num}``."""
    if max_batch_size < 1 or max_step_tokens < 2 or max_context < 32:
        raise ValueError("a sweep needs max_batch_size >= 1, max_step_tokens >= 2 and max_context >= 32")
    chunk = min(split_fuse_token_num or max_step_tokens, max_step_tokens, max_context)
    contexts = sorted({c for c in (64, 256, 1024, max_context) if c <= max_context})
    batches: list[list[Entry]] = []

    def add(*entries: Entry) -> None:
        if (sum(e["request_num"] for e in entries) <= max_batch_size
                and sum(e["forwarding_token_num"] * e["request_num"] for e in entries) <= max_step_tokens
                and all(e["sequence_len"] <= max_context for e in entries)):
            batches.append(list(entries))

    def row(new: int, context: int, num: int = 1) -> Entry:
        return {"forwarding_token_num": new, "sequence_len": context, "request_num": num}

    for q in _powers(16, min(chunk, max_context)):  # whole prompts
        add(row(q, q))
    for q in (64, 256):  # several prompts at once
        add(row(q, q, 4))
    for q in sorted({min(64, chunk), min(256, chunk), chunk}):  # chunks over a cached prefix
        for cached in (q, 3 * q, max_context - q):
            if cached > 0:
                add(row(q, q + cached))
    rows_range = _powers(1, max_batch_size)
    for rows in rows_range:  # decode
        for context in contexts:
            add(row(1, context, rows))
    for q in sorted({min(64, chunk), min(256, chunk), chunk}):  # mixed: a chunk beside decode rows
        for rows in rows_range[::2] + ([rows_range[-1]] if len(rows_range) % 2 == 0 else []):
            for context in (256, 1024):
                if rows + 1 <= max_batch_size and q + rows <= max_step_tokens:
                    add(row(q, min(q + 512, max_context)), row(1, min(context, max_context), rows))
    return batches


def write_batch_config(path: str | Path, batches: list[list[Entry]]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    config = {f"batch_{i}": {"dp_0": entries} for i, entries in enumerate(batches)}
    path.write_bytes(orjson.dumps(config, option=orjson.OPT_INDENT_2) + b"\n")
    return path
