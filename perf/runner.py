"""``run_model_perf``: read and check the inputs, build the engine, run the ModelPerfBackend, write the outputs.

The seed's ``InferenceEngine::Start() -> StartPerf()`` / ``Stop()`` is, here, the engine's event loop running
around ``backend.start_perf()`` (``loop.running()`` starts the actors and stops them on exit). Every input error
is found before the model loads where possible (limits of the step), else right after its config is read (the
model's maximum length, the KV pool), and is a ``PerfConfigError`` naming the file and the batch or key.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import attrs
import trio
import yaml

from ksana.builtin import resolve_model_dir
from ksana.config import KsanaConfig, load_config
from ksana.engine import InferenceEngine, resolve_device, resolve_dtype
from ksana.models.shape import ModelShape
from ksana.perf.backend import BatchResult, ModelPerfBackend, RecordingRunner
from ksana.perf.csv_writer import write_perf_csv
from ksana.perf.operator_profiler import OPERATORS, OperatorProfiler
from ksana.perf.perf_config import (
    BatchConfig,
    ModelPerfConfig,
    PerfConfigError,
    StepLimits,
    check_batches_fit,
    effective_layer_forward_round,
    load_batch_config,
)
from ksana.perf.result_writer import (
    SCHEMA_VERSION,
    batch_json,
    device_info,
    environment_info,
    kernels_info,
    model_info,
    now_iso,
    write_json,
)
from ksana.worker.kv_cache import KVCache
from ksana.worker.memory_budget import available_memory_bytes
from ksana.worker.worker_actor import WorkerActor

logger = logging.getLogger(__name__)

POOL_MARGIN_BLOCKS = 10  # KsanaLLM sizes the perf pool to the largest batch's need plus 10 blocks


@attrs.frozen
class PerfRun:
    result: dict[str, Any]
    batches: list[BatchResult]
    output_file: Path


def _read_shape(model_dir: Path, config: KsanaConfig) -> ModelShape:
    from transformers import AutoConfig

    device = resolve_device(config.setting.global_.device)
    dtype = resolve_dtype(config.model_spec.base_model.dtype, device)
    return ModelShape.from_hf_config(AutoConfig.from_pretrained(model_dir), dtype)


def _size_kv_pool(config: KsanaConfig, batches: BatchConfig, shape: ModelShape) -> None:
    """Without an explicit ``num_device_blocks``, the pool holds the largest batch plus a margin; refuse a batch
    whose KV cache would not fit in memory."""
    blocks = config.setting.block_manager
    if blocks.num_device_blocks > 0:
        return
    block_size = blocks.block_token_num
    largest = max(batches.batches, key=lambda b: b.num_blocks(block_size))
    need = largest.num_blocks(block_size) + POOL_MARGIN_BLOCKS
    bytes_per_block = KVCache.bytes_per_block(shape, block_size, shape.dtype)
    device = resolve_device(config.setting.global_.device)
    usable = available_memory_bytes(device) * (1.0 - blocks.reserved_device_memory_ratio)
    if need * bytes_per_block > usable:
        raise PerfConfigError(
            f"{batches.path}: {largest.name} needs {largest.num_blocks(block_size)} KV blocks "
            f"({need * bytes_per_block / 2**20:.0f} MiB with the margin), more than the {usable / 2**20:.0f} MiB "
            f"of {device.type} memory available")
    blocks.num_device_blocks = need


def _runtime_yaml(path: Path | None) -> Any:
    if path is None:
        return None
    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None  # load_config has already accepted it; this copy is only embedded in the result


def prepare(perf: ModelPerfConfig, engine_overrides: dict[str, Any]) -> tuple[KsanaConfig, BatchConfig, int, Path]:
    """Every check that can run before the model loads: ``(runtime config, batches, layer_forward_round,
    model directory)``; raises ``PerfConfigError``/``ConfigError``/``ValueError`` with a one-line message."""
    batches = load_batch_config(perf.batch_config)
    layer_forward_round = effective_layer_forward_round(perf, batches)
    config = load_config(perf.runtime_config, model_dir=perf.model_dir, **engine_overrides)
    sched, blocks = config.setting.batch_scheduler, config.setting.block_manager
    # Every round replays the same prompts: a prefix cache would turn rounds after the first into cache hits.
    sched.enable_auto_prefix_cache = False
    limits = StepLimits(sched.max_batch_size, sched.max_step_tokens, sched.split_fuse_token_num,
                        blocks.block_token_num, num_blocks=blocks.num_device_blocks or None)
    check_batches_fit(batches, limits)
    model_dir = resolve_model_dir(perf.model_dir)
    shape = _read_shape(model_dir, config)
    max_token_len = min(sched.max_token_len or shape.max_position_embeddings, shape.max_position_embeddings)
    if blocks.num_device_blocks:
        max_token_len = min(max_token_len, blocks.num_device_blocks * blocks.block_token_num)
    check_batches_fit(batches, attrs.evolve(limits, max_token_len=max_token_len))
    _size_kv_pool(config, batches, shape)
    return config, batches, layer_forward_round, model_dir


def run_model_perf(
    perf: ModelPerfConfig,
    engine_overrides: dict[str, Any] | None = None,
    *,
    output_csv: Path | None = None,
    chrome_trace: Path | None = None,
    progress: bool = True,
) -> PerfRun:
    """The whole ``ksana perf`` run; returns the result written to ``perf.output_file``."""
    started_at, started = now_iso(), time.perf_counter()
    config, batches, layer_forward_round, model_dir = prepare(perf, engine_overrides or {})
    engine = InferenceEngine(config)
    model = engine.model
    if not hasattr(model, "set_profiler"):
        raise PerfConfigError(f"{perf.path}: model {model_dir} has no perf-mode hooks (set_profiler)")
    profiler = OperatorProfiler(engine.device, engine.shape.num_layers) if perf.profile_operators else None
    recorder = RecordingRunner(engine.runner)
    backend = ModelPerfBackend(
        batches.batches,
        warmup_rounds=perf.warmup_rounds,
        stat_rounds=perf.stat_rounds,
        vocab_size=engine.shape.vocab_size,
        recorder=recorder,
        profiler=profiler,
        eos_token_ids=engine.eos_token_ids,
        seed=perf.seed,
        source=str(batches.path),
        progress=progress,
    )

    async def start() -> tuple[list[BatchResult], Any]:
        loop = engine.build_loop(backend, worker=WorkerActor(recorder, engine.forward_lane))
        async with loop.running():
            results = await backend.start_perf()
        return results, loop.trace

    model.set_layer_forward_round(layer_forward_round)
    model.set_profiler(profiler)
    try:
        results, trace = trio.run(start)
    finally:
        model.set_profiler(None)
        model.set_layer_forward_round(1)

    block_size = config.setting.block_manager.block_token_num
    sched = config.setting.batch_scheduler
    result = {
        "meta": {
            "schema_version": SCHEMA_VERSION,
            "tool": "ksana perf",
            "started_at": started_at,
            "finished_at": now_iso(),
            "duration_s": round(time.perf_counter() - started, 3),
            "model": model_info(model_dir, engine.shape, sum(p.numel() for p in model.parameters())),
            "device": device_info(engine.device),
            "kernels": kernels_info(engine.device),
            **environment_info(),
            "runtime": {
                "block_token_num": block_size,
                "num_device_blocks": engine.num_blocks,
                "max_batch_size": sched.max_batch_size,
                "max_step_tokens": sched.max_step_tokens,
                "split_fuse_token_num": sched.split_fuse_token_num,
                "max_token_len": engine.scheduler.max_token_len,
                "tensor_para_size": config.setting.global_.tensor_para_size,
            },
            "warmup_rounds": perf.warmup_rounds,
            "stat_rounds": perf.stat_rounds,
            "layer_forward_round": layer_forward_round,
            "profile_operators": perf.profile_operators,
            "operator_timing": profiler.timing_method if profiler is not None else None,
            "operators": list(OPERATORS),
            "seed": perf.seed,
            "inputs": {
                "model_perf_config": {"path": str(perf.path), "content": perf.raw},
                "batch_config": {"path": str(batches.path), "content": batches.raw},
                "runtime_config": None if perf.runtime_config is None else {
                    "path": str(perf.runtime_config), "content": _runtime_yaml(perf.runtime_config)},
            },
        },
        "batches": [batch_json(r, block_size, engine.shape.num_layers) for r in results],
    }
    write_json(perf.output_file, result)
    logger.info("perf result written to %s", perf.output_file)
    if output_csv is not None:
        rows = [(r.batch, sum(m.forward_ms for m in r.rounds) / len(r.rounds)) for r in results]
        write_perf_csv(output_csv, rows, perf.stat_rounds, layer_forward_round)
        logger.info("perf CSV written to %s", output_csv)
    if chrome_trace is not None:
        trace.write_chrome_trace(chrome_trace)
    return PerfRun(result, results, perf.output_file)
