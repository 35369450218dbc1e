"""Perf results (``model_perf_result.json``) as fitting samples: one per batch, its shape and its latencies.

A batch's latency is the median over its stat rounds. The worker's part is what the forward thread is busy with
(prepare + forward + sample); the engine's part is the rest of the step (scheduling, the block exchange, the
messages, the update after the result), which async scheduling overlaps with the next forward. Profiles from
several files combine only when they describe the same model shape, dtype and device.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import orjson

from ksana.simulator.features import StepShape

# Operator groups of the perf result (``perf/operator_profiler.py``), for the per-group fits.
OPERATOR_GROUPS: dict[str, tuple[str, ...]] = {
    "projections": ("qkv_proj", "o_proj", "mlp_gate_up", "mlp_down", "lm_head"),
    "prefill_attention": ("attention_prefill",),
    "decode_attention": ("attention_decode",),
    "other": ("embedding", "rotary", "norm", "kv_cache_store", "mlp_act", "all_reduce", "sampler"),
}
# What must agree between profiles (and between a fit and the engine it simulates).
IDENTITY_KEYS = ("model_type", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                 "intermediate_size", "vocab_size", "dtype")


class ProfileError(ValueError):
    """A profile that cannot be read or fitted; the message names the file and the key."""


@attrs.frozen
class Sample:
    batch: str
    shape: StepShape
    worker_ms: float
    engine_ms: float
    groups_ms: dict[str, float] | None  # per operator group, when the profile timed operators


@attrs.frozen
class Profile:
    paths: tuple[Path, ...]
    meta: dict[str, Any]  # the first file's metadata (model, device, versions, ...)
    samples: tuple[Sample, ...]

    @property
    def identity(self) -> dict[str, Any]:
        return identity(self.meta)


def identity(meta: dict[str, Any]) -> dict[str, Any]:
    """What ties latencies to a configuration: the model's shape and dtype, the device and its threads."""
    model, device = meta.get("model", {}), meta.get("device", {})
    return {**{key: model.get(key) for key in IDENTITY_KEYS}, "device_type": device.get("type"),
            "device_name": device.get("name"), "num_threads": device.get("num_threads"),
            "kernels": meta.get("kernels")}


def read_json(path: Path) -> Any:
    """A JSON file, or a ``ProfileError`` naming it."""
    try:
        return orjson.loads(path.read_bytes())
    except OSError as error:
        raise ProfileError(f"{path}: cannot read: {error.strerror or error}") from None
    except orjson.JSONDecodeError as error:
        raise ProfileError(f"{path}: not JSON: {error}") from None


def _read(path: Path) -> dict[str, Any]:
    data = read_json(path)
    if not isinstance(data, dict) or "meta" not in data or not isinstance(data.get("batches"), list):
        raise ProfileError(f"{path}: not a perf result (no 'meta' and 'batches'; see docs/perf_result.md)")
    return data


def _sample(path: Path, batch: dict[str, Any]) -> Sample:
    name = batch.get("name", "?")
    try:
        shape = StepShape.from_perf_requests(batch["requests"])
        rounds = batch["rounds"]
        workers = [r["prepare_ms"] + r["forward_ms"] + r["sample_ms"] for r in rounds]
        engines = [r["step_ms"] - w for r, w in zip(rounds, workers, strict=True)]
    except (KeyError, TypeError) as error:
        raise ProfileError(f"{path}: batch {name}: missing or malformed key {error}") from None
    if not rounds:
        raise ProfileError(f"{path}: batch {name}: no stat rounds")
    groups = None
    if all(r.get("operators") for r in rounds):
        groups = {group: statistics.median(sum(r["operators"][op]["total_ms"] for op in ops
                                               if op in r["operators"]) for r in rounds)
                  for group, ops in OPERATOR_GROUPS.items()}
    return Sample(name, shape, statistics.median(workers), max(0.0, statistics.median(engines)), groups)


def load_profile(paths: Sequence[str | Path]) -> Profile:
    """Read one or more perf results of one configuration into samples (each batch of each file)."""
    if not paths:
        raise ProfileError("no perf result given")
    paths = tuple(Path(p) for p in paths)
    first = _read(paths[0])
    samples: list[Sample] = []
    for path in paths:
        data = first if path == paths[0] else _read(path)
        if identity(data["meta"]) != identity(first["meta"]):
            diff = {k: (v, identity(data["meta"])[k]) for k, v in identity(first["meta"]).items()
                    if identity(data["meta"])[k] != v}
            raise ProfileError(f"{path}: another configuration than {paths[0]}: {diff}")
        samples += [_sample(path, batch) for batch in data["batches"]]
    if len(samples) < 3:
        raise ProfileError(f"{paths[0]}: {len(samples)} batches; a fit needs at least 3 (see 'ksana simulate "
                           "sweep')")
    return Profile(paths, first["meta"], tuple(samples))
