"""InferenceEngine: loads the model once and assembles the actors around an event loop.

The assembly is where the three products differ by one actor: serving plugs in the HTTP I/O actor, perf mode the
ModelPerfBackend, the simulator a workload replayer and a simulated worker. Scheduler and cache manager are always
the same classes.
"""

from __future__ import annotations

import atexit
import gc
import logging
import time
from pathlib import Path

import attrs
import torch

from ksana.builtin import resolve_model_dir
from ksana.cache.cache_manager_actor import CacheManagerActor, make_cache_manager
from ksana.cache.direct_cache_manager import num_blocks_for
from ksana.cache.interface import CacheManager
from ksana.cache.remote_loading import FilesystemKVStore, store_namespace
from ksana.config import ConfigError, KsanaConfig
from ksana.events import Actor, BlockingLane, EventLoop
from ksana.events.clock import Clock
from ksana.models.registry import load_model
from ksana.models.shape import ModelShape
from ksana.scheduler.batch_scheduler import BatchScheduler
from ksana.scheduler.scheduler_actor import SchedulerActor
from ksana.scheduler.step_log import StepLog
from ksana.tokenizer import load_tokenizer
from ksana.worker.fresh_thread import run_in_fresh_thread
from ksana.worker.kv_cache import KVCache
from ksana.worker.memory_budget import plan_num_blocks
from ksana.worker.model_runner import ModelRunner
from ksana.worker.mtp_drafter import MTPDrafter
from ksana.worker.tp_runner import TPModelRunner
from ksana.worker.worker_actor import WorkerActor

logger = logging.getLogger(__name__)
atexit.register(gc.unfreeze)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("config key 'setting.global.device' is cuda, but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` is float32 on CPU (the fast path without bf16 hardware) and bfloat16 on accelerators."""
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return _DTYPES[name]


def _check_mtp(config: KsanaConfig, num_mtp_layers: int) -> None:
    """MTP drafting needs the model's MTP modules: one (reused for every draft) or one per draft."""
    steps, key = config.setting.batch_scheduler.mtp_step_num, "setting.batch_scheduler.mtp_step_num"
    if not steps:
        return
    if num_mtp_layers == 0:
        raise ConfigError(f"config key '{key}': the model has no MTP modules (no num_nextn_predict_layers weights)")
    if num_mtp_layers > 1 and steps > num_mtp_layers:
        raise ConfigError(f"config key '{key}' is {steps}, but the model's {num_mtp_layers} MTP modules draft "
                          f"{num_mtp_layers} tokens at most")


@attrs.frozen
class EngineLayout:
    """What the configuration and the model's shape decide before any weight loads: the KV pool and the
    longest sequence. The engine and the simulator size themselves with the same ``plan_layout``, so a
    simulated engine preempts where the real one would."""

    block_size: int
    num_blocks: int
    bytes_per_block: int
    max_token_len: int
    sliding_window: int | None  # the SWA pool's window (prefix cache on a sliding-window model), else None
    num_swa_blocks: int
    num_extra_layers: int = 0  # the MTP modules' cache layers, after the model's own


def plan_layout(config: KsanaConfig, shape: ModelShape, budget_shape: ModelShape, device: torch.device,
                dtype: torch.dtype, unloaded_weight_bytes: int = 0, budget_copies: int = 1) -> EngineLayout:
    """``budget_shape``: the shape of the KV one rank holds (its share under tensor parallelism), of which the
    device's memory holds ``budget_copies`` (every rank's, where the ranks share one memory, as on the CPU).
    ``unloaded_weight_bytes``: weights not in memory yet (the simulator loads none), taken off the memory the pool
    is sized from."""
    sched = config.setting.batch_scheduler
    model_max = shape.max_position_embeddings
    max_token_len = min(sched.max_token_len or model_max, model_max)
    block_size = config.setting.block_manager.block_token_num
    # MTP drafting keeps its modules' K/V in the same blocks, as extra layers.
    extra_layers = shape.num_mtp_layers if sched.mtp_step_num else 0
    bytes_per_block = budget_copies * KVCache.bytes_per_block(budget_shape, block_size, dtype,
                                                              extra_layers=extra_layers)
    max_useful = sched.max_batch_size * num_blocks_for(max_token_len, block_size)
    num_blocks = plan_num_blocks(config.setting.block_manager, bytes_per_block, device, max_useful,
                                 unloaded_weight_bytes)
    # Prefix cache on a sliding-window model: the sliding layers get their own SWA block pool, so a cached
    # prefix's SWA copy can be evicted on its own (SWACacheManager); as many blocks as the FA pool by default.
    # (Tensor-parallel ranks keep one pool: sliding layers then read the FA tables, as without the cache.)
    windows = [w for w in shape.sliding_windows if w is not None]
    use_swa_pool = (bool(windows) and sched.enable_auto_prefix_cache
                    and config.setting.global_.tensor_para_size == 1)
    num_swa_blocks = (config.setting.block_manager.num_swa_blocks or num_blocks) if use_swa_pool else 0
    return EngineLayout(block_size, num_blocks, bytes_per_block, max_token_len,
                        max(windows) if use_swa_pool else None, num_swa_blocks, extra_layers)


def build_scheduling(config: KsanaConfig, layout: EngineLayout,
                     remote_store: FilesystemKVStore | None = None) -> tuple[BatchScheduler, CacheManager]:
    """The scheduler and the cache manager a layout gets: the same objects for serving, perf mode and the
    simulator."""
    sched = config.setting.batch_scheduler
    manager = make_cache_manager(layout.num_blocks, layout.block_size, sched.enable_auto_prefix_cache,
                                 layout.sliding_window, layout.num_swa_blocks, remote_store)
    connector = config.setting.connector
    scheduler = BatchScheduler(sched, layout.block_size, layout.num_blocks, layout.max_token_len,
                               kv_wait_s=float(connector.connector_waiting_sec))
    scheduler.awaits_kv = connector.group_role == "decode"
    return scheduler, manager


def assemble_loop(scheduler: BatchScheduler, cache_manager: CacheManager, worker: Actor, io_actor: Actor,
                  clock: Clock | None = None, trace_capacity: int | None = None,
                  step_log: StepLog | None = None) -> EventLoop:
    """The one assembly of every product: the scheduler and cache-manager actors around the given state, the
    worker (real or simulated) and the I/O side (server, offline, perf backend or workload replayer)."""
    loop = EventLoop(clock=clock) if trace_capacity is None else EventLoop(clock=clock, trace_capacity=trace_capacity)
    loop.register(SchedulerActor(scheduler, step_log))
    loop.register(CacheManagerActor(cache_manager))
    loop.register(worker)
    loop.register(io_actor)
    return loop


class InferenceEngine:
    """The model, its KV pool and the persistent scheduler/cache state; ``build_loop`` wires a run."""

    def __init__(self, config: KsanaConfig) -> None:
        self.config = config
        base = config.model_spec.base_model
        self.model_dir: Path = resolve_model_dir(base.model_dir)
        self.device = resolve_device(config.setting.global_.device)
        self.dtype = resolve_dtype(base.dtype, self.device)
        if config.setting.global_.num_threads > 0:
            torch.set_num_threads(config.setting.global_.num_threads)

        started = time.perf_counter()
        logger.info("loading model %s (%s on %s)", self.model_dir, str(self.dtype).removeprefix("torch."), self.device)
        self.tokenizer = load_tokenizer(self.model_dir)
        # Tensor parallelism: ranks 1..N-1 load their shards elsewhere; self.model is rank 0's shard.
        tp_size = config.setting.global_.tensor_para_size
        self.tp_runner: TPModelRunner | None = None
        if tp_size > 1:
            self.tp_runner = TPModelRunner.launch(tp_size, self.model_dir, self.dtype, self.device,
                                                  config.setting.global_.num_threads)
            self.model = self.tp_runner.model
        else:
            # Tensor work of the start-up runs on a thread of its own: see ksana/worker/fresh_thread.py.
            self.model = run_in_fresh_thread(load_model, self.model_dir, dtype=self.dtype, device=self.device)
        self.shape = self.model.shape
        _check_mtp(config, self.shape.num_mtp_layers)
        logger.info("model loaded in %.1f s", time.perf_counter() - started)

        # Each TP rank holds its share of a block (its KV heads; all of an MLA model's latent); on CPU the ranks
        # share one memory, so size by every rank's.
        kv_shape = getattr(self.model, "rank_shape", self.shape)
        copies = tp_size if self.device.type == "cpu" else 1
        self.layout = plan_layout(config, self.shape, kv_shape, self.device, self.dtype, budget_copies=copies)
        layout = self.layout
        self.max_token_len = layout.max_token_len
        self.kv_cache = run_in_fresh_thread(KVCache.allocate, kv_shape, layout.num_blocks, layout.block_size,
                                            self.dtype, self.device, num_swa_blocks=layout.num_swa_blocks,
                                            head_major=self.model.kv_head_major, extra_layers=layout.num_extra_layers)
        logger.info("KV pool: %d blocks x %d tokens = %d tokens (%.1f MiB)%s", layout.num_blocks,
                    layout.block_size, layout.num_blocks * layout.block_size,
                    layout.num_blocks * layout.bytes_per_block / 2**20,
                    f", {layout.num_swa_blocks} SWA blocks" if layout.num_swa_blocks else "")

        mtp_steps = config.setting.batch_scheduler.mtp_step_num
        if self.tp_runner is None:
            self.runner = ModelRunner(self.model, self.kv_cache, self.device)
            if mtp_steps:
                self.runner.mtp_drafter = MTPDrafter(self.model, self.kv_cache.layers[self.shape.num_layers:],
                                                     mtp_steps, layout.block_size)
        else:
            self.runner = self.tp_runner.start(self.kv_cache, mtp_steps)
        remote_store = None
        remote_dir = config.setting.block_manager.remote_cache_dir
        if remote_dir:
            if self.tp_runner is not None:
                raise ConfigError("config key 'setting.block_manager.remote_cache_dir': remote cache loading "
                                  "is not implemented with tensor parallelism")
            remote_store = FilesystemKVStore(remote_dir,
                                             store_namespace(self.model_dir, layout.block_size, self.dtype))
            self.runner.remote_store = remote_store
        role = config.setting.connector.group_role
        if role != "none" and layout.num_swa_blocks:
            raise ConfigError("config key 'setting.connector.group_role': prefill/decode disaggregation is not "
                              "implemented with a separate sliding-window KV pool")
        self.scheduler, self.cache_manager = build_scheduling(config, layout, remote_store)
        self.eos_token_ids = _eos_token_ids(self.tokenizer, self.shape)
        # Every forward of the engine's life on one thread, across loops (each generate, a server's life): one
        # OpenMP pool, and a lighter hand-off than trio's thread cache (events/lane.py).
        self.forward_lane = BlockingLane("ksana-forward")
        # What start-up built (the model's modules, the tokenizer's vocabulary: hundreds of thousands of objects)
        # lives as long as the engine: frozen out of the collector's sight, so the full collections that a decode
        # loop's garbage triggers do not walk it each time (3% of a batch-1 step's samples before; vLLM does the
        # same after start-up). Thawed at exit, so the interpreter's last collection still frees what it holds.
        gc.collect()
        gc.freeze()

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    def close(self) -> None:
        """End the forward thread and stop the tensor-parallel ranks, if any (they are also stopped at exit)."""
        self.forward_lane.close()
        if self.tp_runner is not None:
            self.tp_runner.close()

    def build_loop(self, io_actor: Actor, clock: Clock | None = None, worker: Actor | None = None,
                   step_log: StepLog | None = None) -> EventLoop:
        """A fresh loop with the engine's scheduler, cache manager and worker, and the given I/O actor."""
        worker = worker if worker is not None else WorkerActor(self.runner, self.forward_lane)
        return assemble_loop(self.scheduler, self.cache_manager, worker, io_actor, clock, step_log=step_log)


def _eos_token_ids(tokenizer, shape) -> tuple[int, ...]:
    """EOS ids as ``generate`` would use them: config.json and generation_config.json, else the tokenizer's."""
    ids = list(shape.eos_token_ids)
    if not ids and tokenizer is not None and tokenizer.eos_token_id is not None:
        ids = [tokenizer.eos_token_id]
    return tuple(ids)
