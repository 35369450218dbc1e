"""Readers of ``model_perf_config.json`` and ``batch_config.json``, and the check that each batch fits one step.

Every error is a ``PerfConfigError`` whose message names the file and the key or batch at fault, so ``ksana perf``
can print it as one line and exit 2. Relative paths inside ``model_perf_config.json`` (``batch_config``,
``runtime_config``, ``output_file``, a model directory) are taken relative to that file's folder, so a config and
its batches can be moved together.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import attrs
import orjson

from ksana.builtin import BUILTIN_MODELS
from ksana.cache.direct_cache_manager import num_blocks_for
from ksana.config import ConfigError


class PerfConfigError(ConfigError):
    """Bad perf-mode input: the message names the file and the key or batch."""


MAX_LAYER_FORWARD_ROUND = 99  # KsanaLLM requires layer_forward_round < 100
DECODE_TOKEN_NUM_THRESHOLD = 1  # KsanaLLM: forwarding_token_num <= threshold is a decode (no MTP here)


@attrs.frozen
class RequestSpec:
    """``request_num`` identical requests forwarding ``forwarding_token_num`` tokens at the end of a
    ``sequence_len``-token sequence whose first ``sequence_len - forwarding_token_num`` tokens are cached."""

    forwarding_token_num: int
    sequence_len: int
    request_num: int = 1

    @property
    def is_decode(self) -> bool:
        return self.forwarding_token_num <= DECODE_TOKEN_NUM_THRESHOLD

    @property
    def num_cached_tokens(self) -> int:
        return self.sequence_len - self.forwarding_token_num

    def to_json(self) -> dict[str, Any]:
        return {
            "forwarding_token_num": self.forwarding_token_num,
            "sequence_len": self.sequence_len,
            "request_num": self.request_num,
            "kind": "decode" if self.is_decode else "prefill",
            "num_cached_tokens": self.num_cached_tokens,
        }


@attrs.frozen
class BatchSpec:
    """One batch of ``batch_config.json`` (its ``dp_0`` list): replayed as one engine step per round."""

    name: str
    requests: tuple[RequestSpec, ...]

    def _sum(self, fn, kind: str | None = None) -> int:
        return sum(fn(r) * r.request_num for r in self.requests
                   if kind is None or (kind == "decode") == r.is_decode)

    @property
    def num_requests(self) -> int:
        return self._sum(lambda r: 1)

    @property
    def num_decode_requests(self) -> int:
        return self._sum(lambda r: 1, "decode")

    @property
    def num_prefill_requests(self) -> int:
        return self._sum(lambda r: 1, "prefill")

    @property
    def num_tokens(self) -> int:
        """Tokens forwarded in the step (the ``max_step_tokens`` budget it uses)."""
        return self._sum(lambda r: r.forwarding_token_num)

    @property
    def num_decode_tokens(self) -> int:
        return self._sum(lambda r: r.forwarding_token_num, "decode")

    @property
    def num_prefill_tokens(self) -> int:
        return self._sum(lambda r: r.forwarding_token_num, "prefill")

    @property
    def total_sequence_len(self) -> int:
        return self._sum(lambda r: r.sequence_len)

    @property
    def num_cached_tokens(self) -> int:
        return self._sum(lambda r: r.num_cached_tokens)

    def num_blocks(self, block_size: int) -> int:
        """KV blocks the step holds: every request's whole sequence."""
        return self._sum(lambda r: num_blocks_for(r.sequence_len, block_size))


@attrs.frozen
class ModelPerfConfig:
    """``model_perf_config.json`` after validation; ``raw`` is the file's content as read (embedded in results)."""

    path: Path
    model_dir: str
    batch_config: Path
    runtime_config: Path | None = None
    warmup_rounds: int = 2
    stat_rounds: int = 10
    output_file: Path = Path("model_perf_result.json")
    profile_operators: bool = True
    layer_forward_round: int | None = None  # None: batch_config.json's, else 1
    seed: int = 42
    raw: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class BatchConfig:
    path: Path
    batches: tuple[BatchSpec, ...]
    layer_forward_round: int | None
    raw: dict[str, Any]


# key -> (what a valid value is, its check)
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_PERF_KEYS: dict[str, tuple[str, Any]] = {
    "model_dir": ("a string (a model directory or a built-in name: smollm2, demo)", lambda v: isinstance(v, str) and v),
    "batch_config": ("a string (path of batch_config.json)", lambda v: isinstance(v, str) and v),
    "runtime_config": ("a string (path of a runtime YAML) or null", lambda v: v is None or (isinstance(v, str) and v)),
    "warmup_rounds": ("an integer >= 0", lambda v: _is_int(v) and v >= 0),
    "stat_rounds": ("an integer >= 1", lambda v: _is_int(v) and v >= 1),
    "output_file": ("a string (path of the result JSON)", lambda v: isinstance(v, str) and v),
    "profile_operators": ("true or false", lambda v: isinstance(v, bool)),
    "layer_forward_round": (f"an integer from 1 to {MAX_LAYER_FORWARD_ROUND}",
                            lambda v: _is_int(v) and 1 <= v <= MAX_LAYER_FORWARD_ROUND),
    "seed": ("an integer", _is_int),
}
_REQUIRED_PERF_KEYS = ("model_dir", "batch_config")
_REQUEST_KEYS = ("forwarding_token_num", "sequence_len", "request_num")
_BATCH_NAME = re.compile(r"batch_\d+")
_DP_NAME = re.compile(r"dp_\d+")


def _describe(value: Any) -> str:
    kind = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}
    return f"{kind.get(type(value), type(value).__name__) if value is not None else 'null'} {orjson.dumps(value).decode()}"


def read_json(path: Path, what: str) -> Any:
    """The parsed file; a missing file or bad JSON is a ``PerfConfigError`` naming ``path``."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise PerfConfigError(f"{path}: {what} not found") from None
    except OSError as exc:
        raise PerfConfigError(f"{path}: cannot read {what}: {exc.strerror}") from None
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise PerfConfigError(f"{path}: {what} is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})"
                              ) from None


def _resolve(base: Path, value: str) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() else base / path


def load_model_perf_config(path: str | Path, overrides: dict[str, Any] | None = None) -> ModelPerfConfig:
    """Read and check ``model_perf_config.json``; ``overrides`` (CLI flags, ``None`` = unset) win over the file."""
    path = Path(path)
    raw = read_json(path, "model perf config")
    if not isinstance(raw, dict):
        raise PerfConfigError(f"{path}: must be a JSON object with keys {', '.join(_PERF_KEYS)}, got {_describe(raw)}")
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in _PERF_KEYS:
            raise PerfConfigError(f"{path}: unknown key '{key}' (known keys: {', '.join(_PERF_KEYS)})")
        values[key] = value
    for key, value in (overrides or {}).items():
        if value is not None:
            values[key] = value
    for key, value in values.items():
        expected, ok = _PERF_KEYS[key]
        if not ok(value):
            raise PerfConfigError(f"{path}: key '{key}' must be {expected}, got {_describe(value)}")
    for key in _REQUIRED_PERF_KEYS:
        if key not in values:
            raise PerfConfigError(f"{path}: missing key '{key}'")
    base = path.parent
    model_dir = values["model_dir"]
    if model_dir not in BUILTIN_MODELS:
        model_dir = str(_resolve(base, model_dir))
    runtime = values.get("runtime_config")
    return ModelPerfConfig(
        path=path,
        model_dir=model_dir,
        batch_config=_resolve(base, values["batch_config"]),
        runtime_config=_resolve(base, runtime) if runtime else None,
        warmup_rounds=values.get("warmup_rounds", 2),
        stat_rounds=values.get("stat_rounds", 10),
        output_file=_resolve(base, values.get("output_file", "model_perf_result.json")),
        profile_operators=values.get("profile_operators", True),
        layer_forward_round=values.get("layer_forward_round"),
        seed=values.get("seed", 42),
        raw=raw,
    )


def _request_spec(path: Path, where: str, entry: Any) -> RequestSpec:
    if not isinstance(entry, dict):
        raise PerfConfigError(f"{path}: {where} must be an object with keys {', '.join(_REQUEST_KEYS)}, "
                              f"got {_describe(entry)}")
    for key in entry:
        if key not in _REQUEST_KEYS:
            raise PerfConfigError(f"{path}: {where}: unknown key '{key}' (known keys: {', '.join(_REQUEST_KEYS)})")
    for key in ("forwarding_token_num", "sequence_len"):
        if key not in entry:
            raise PerfConfigError(f"{path}: {where}: missing key '{key}'")
    for key, value in entry.items():
        if not (_is_int(value) and value >= 1):
            raise PerfConfigError(f"{path}: {where}.{key} must be an integer >= 1, got {_describe(value)}")
    spec = RequestSpec(**entry)
    if spec.forwarding_token_num > spec.sequence_len:
        raise PerfConfigError(f"{path}: {where}: forwarding_token_num {spec.forwarding_token_num} exceeds "
                              f"sequence_len {spec.sequence_len} (the forwarded tokens are the sequence's last ones)")
    return spec


def _batch_spec(path: Path, name: str, body: Any) -> BatchSpec:
    if not isinstance(body, dict):
        raise PerfConfigError(f"{path}: {name} must be an object mapping dp_0 to a list of requests, "
                              f"got {_describe(body)}")
    for key in body:
        if key == "dp_0":
            continue
        if _DP_NAME.fullmatch(key):
            raise PerfConfigError(f"{path}: {name}.{key}: this build runs one attention data-parallel group, "
                                  "so a batch has only dp_0")
        raise PerfConfigError(f"{path}: {name}: unknown key '{key}' (a batch maps dp_0 to a list of requests)")
    if "dp_0" not in body:
        raise PerfConfigError(f"{path}: {name}: missing key 'dp_0'")
    entries = body["dp_0"]
    if not isinstance(entries, list) or not entries:
        raise PerfConfigError(f"{path}: {name}.dp_0 must be a non-empty list of requests, got {_describe(entries)}")
    return BatchSpec(name, tuple(_request_spec(path, f"{name}.dp_0[{i}]", e) for i, e in enumerate(entries)))


def load_batch_config(path: str | Path) -> BatchConfig:
    """Read and check ``batch_config.json``: ``batch_N`` keys (file order kept) and an optional
    ``layer_forward_round`` (KsanaLLM's perf-config key)."""
    path = Path(path)
    raw = read_json(path, "batch config")
    if not isinstance(raw, dict):
        raise PerfConfigError(f"{path}: must be a JSON object of batches (batch_0, batch_1, ...), got {_describe(raw)}")
    batches = []
    layer_forward_round = None
    for key, body in raw.items():
        if key == "layer_forward_round":
            expected, ok = _PERF_KEYS[key]
            if not ok(body):
                raise PerfConfigError(f"{path}: key '{key}' must be {expected}, got {_describe(body)}")
            layer_forward_round = body
        elif _BATCH_NAME.fullmatch(key):
            batches.append(_batch_spec(path, key, body))
        else:
            raise PerfConfigError(f"{path}: unknown key '{key}' (batches are named batch_0, batch_1, ...; "
                                  "layer_forward_round is the only other key)")
    if not batches:
        raise PerfConfigError(f"{path}: no batches (expected keys batch_0, batch_1, ...)")
    return BatchConfig(path, tuple(batches), layer_forward_round, raw)


def effective_layer_forward_round(perf: ModelPerfConfig, batches: BatchConfig) -> int:
    """model_perf_config.json's value, else batch_config.json's, else 1; two different values are an error."""
    a, b = perf.layer_forward_round, batches.layer_forward_round
    if a is not None and b is not None and a != b:
        raise PerfConfigError(f"{perf.path}: layer_forward_round is {a} but {batches.path} says {b}; "
                              "give it in one file")
    return a if a is not None else b if b is not None else 1


@attrs.frozen
class StepLimits:
    """What one engine step can hold, from the runtime config and the KV pool."""

    max_batch_size: int
    max_step_tokens: int
    split_fuse_token_num: int
    block_size: int
    max_token_len: int | None = None  # None: not known yet (before the model's config is read)
    num_blocks: int | None = None  # None: the pool is sized to the batches


def check_batches_fit(batch_config: BatchConfig, limits: StepLimits) -> None:
    """Every batch must run as exactly one step; the first one that cannot is named with the limit it breaks."""
    path = batch_config.path
    for batch in batch_config.batches:
        name = batch.name
        if batch.num_requests > limits.max_batch_size:
            raise PerfConfigError(
                f"{path}: {name} has {batch.num_requests} requests, more than setting.batch_scheduler."
                f"max_batch_size={limits.max_batch_size}, so it cannot run as one step")
        if batch.num_tokens > limits.max_step_tokens:
            raise PerfConfigError(
                f"{path}: {name} forwards {batch.num_tokens} tokens, more than setting.batch_scheduler."
                f"max_step_tokens={limits.max_step_tokens}, so it cannot run as one step")
        for i, spec in enumerate(batch.requests):
            where = f"{name}.dp_0[{i}]"
            if limits.split_fuse_token_num and spec.forwarding_token_num > limits.split_fuse_token_num:
                raise PerfConfigError(
                    f"{path}: {where} forwards {spec.forwarding_token_num} tokens, more than setting.batch_scheduler."
                    f"split_fuse_token_num={limits.split_fuse_token_num}, so the scheduler would split it into chunks")
            if limits.max_token_len is not None and spec.sequence_len >= limits.max_token_len:
                raise PerfConfigError(
                    f"{path}: {where} has sequence_len {spec.sequence_len}, but sequences must stay below "
                    f"max_token_len={limits.max_token_len} (the model's maximum or setting.batch_scheduler.max_token_len)")
        need = batch.num_blocks(limits.block_size)
        if limits.num_blocks is not None and need > limits.num_blocks:
            raise PerfConfigError(
                f"{path}: {name} needs {need} KV blocks of {limits.block_size} tokens, but the KV pool has "
                f"{limits.num_blocks} (setting.block_manager.num_device_blocks)")
