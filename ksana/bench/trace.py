"""The request trace that the load generator replays against a server and the simulator replays on its clock.

JSONL, one request a line, in arrival order::

    {"arrival_time_s": 0.0, "prompt_len": 128, "output_len": 64}
    {"arrival_time_s": 0.4, "prompt_len": 7, "output_len": 16, "prompt_token_ids": [1, 2, 3, 4, 5, 6, 7]}

``arrival_time_s`` counts from the start of the run. Without ``prompt_token_ids`` a request's prompt is seeded
random token ids (``prompt_ids``), the same for both replays, so a real server and the simulator see the same
tokens; with them, prefix-cache hits are real in both. Outputs run to ``output_len`` tokens (``ignore_eos``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from pathlib import Path

import attrs
import orjson

FIELDS = ("arrival_time_s", "prompt_len", "output_len")


class TraceError(ValueError):
    """A malformed trace; the message names the file and line."""


@attrs.frozen
class TraceRequest:
    arrival_time_s: float
    prompt_len: int
    output_len: int
    prompt_token_ids: tuple[int, ...] | None = None

    def to_json(self) -> dict:
        row: dict = {"arrival_time_s": self.arrival_time_s, "prompt_len": self.prompt_len,
                     "output_len": self.output_len}
        if self.prompt_token_ids is not None:
            row["prompt_token_ids"] = list(self.prompt_token_ids)
        return row


def _positive_int(value: object, where: str, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TraceError(f"{where}: '{key}' must be a whole number >= 1, got {value!r}")
    return value


def parse_line(line: str, where: str, previous_arrival: float) -> TraceRequest:
    try:
        row = orjson.loads(line)
    except orjson.JSONDecodeError as error:
        raise TraceError(f"{where}: not JSON: {error}") from None
    if not isinstance(row, dict):
        raise TraceError(f"{where}: expected an object with {', '.join(FIELDS)}")
    missing = [key for key in FIELDS if key not in row]
    if missing:
        raise TraceError(f"{where}: missing {', '.join(repr(k) for k in missing)}")
    arrival = row["arrival_time_s"]
    if isinstance(arrival, bool) or not isinstance(arrival, int | float) or not math.isfinite(arrival) \
            or arrival < 0:
        raise TraceError(f"{where}: 'arrival_time_s' must be a number >= 0, got {arrival!r}")
    if arrival < previous_arrival:
        raise TraceError(f"{where}: 'arrival_time_s' {arrival} is before the line above's {previous_arrival}: "
                         "the trace must be in arrival order")
    prompt_len = _positive_int(row["prompt_len"], where, "prompt_len")
    output_len = _positive_int(row["output_len"], where, "output_len")
    ids = row.get("prompt_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                for t in ids):
            raise TraceError(f"{where}: 'prompt_token_ids' must be a list of token ids >= 0")
        if len(ids) != prompt_len:
            raise TraceError(f"{where}: 'prompt_token_ids' has {len(ids)} ids, 'prompt_len' says {prompt_len}")
        ids = tuple(ids)
    return TraceRequest(float(arrival), prompt_len, output_len, ids)


def read_trace(path: str | Path) -> list[TraceRequest]:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise TraceError(f"{path}: cannot read: {error.strerror or error}") from None
    requests: list[TraceRequest] = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            previous = requests[-1].arrival_time_s if requests else 0.0
            requests.append(parse_line(line, f"{path}:{number}", previous))
    if not requests:
        raise TraceError(f"{path}: no requests")
    return requests


def check_fits(requests: Sequence[TraceRequest], max_token_len: int, vocab_size: int, source: str) -> None:
    """Refuse a request the model cannot take: longer than ``max_token_len`` in all, or with ids past the vocab."""
    for index, request in enumerate(requests):
        if request.prompt_len + request.output_len > max_token_len:
            raise TraceError(f"{source}: request {index} (line {index + 1}): prompt_len + output_len = "
                             f"{request.prompt_len + request.output_len} exceeds the model's {max_token_len} tokens")
        ids = request.prompt_token_ids
        if ids is not None and max(ids) >= vocab_size:
            raise TraceError(f"{source}: request {index} (line {index + 1}): token id {max(ids)} is outside the "
                             f"vocabulary of {vocab_size}")


def write_trace(path: str | Path, requests: Sequence[TraceRequest]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(orjson.dumps(r.to_json()) + b"\n" for r in requests))
    return path


def arrival_times(num: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds from the start: all zero at an infinite rate, else gamma gaps (shape ``burstiness``, mean
    ``1 / rate``); burstiness 1 is a Poisson process, below 1 burstier, above 1 more regular."""
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * num
    if rate <= 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    rng = random.Random(seed + 1)
    times, now = [], 0.0
    for _ in range(num):
        times.append(now)
        now += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return times


def synthetic_trace(num: int, rate: float, input_len: tuple[int, int], output_len: tuple[int, int],
                    burstiness: float = 1.0, seed: int = 0) -> list[TraceRequest]:
    """Lengths uniform in each ``(low, high)`` range, arrivals from ``arrival_times``; seeded."""
    rng = random.Random(seed)
    return [TraceRequest(round(at, 6), rng.randint(*input_len), rng.randint(*output_len))
            for at in arrival_times(num, rate, burstiness, seed)]


def prompt_ids(request: TraceRequest, index: int, vocab_size: int, seed: int = 0) -> list[int]:
    """The request's prompt: its own ids, else seeded random ids that skip the low ids where special and byte
    tokens live (so a prompt never holds an end-of-sequence or control token)."""
    if request.prompt_token_ids is not None:
        return list(request.prompt_token_ids)
    rng = random.Random(f"{seed}:{index}")
    low = 256 if vocab_size > 1024 else 3
    return [rng.randrange(low, vocab_size) for _ in range(request.prompt_len)]
