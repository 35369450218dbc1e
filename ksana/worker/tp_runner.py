"""Rank 0's side of tensor parallelism: places the ranks, loads rank 0's shard, drives every step.

Rank 0 lives in the engine's process and its ``TPModelRunner`` stands where the ``ModelRunner`` stands: the worker
actor keeps its shape (``ExecuteStep`` in, ``StepResult`` out) and perf mode profiles rank 0's model as usual.
Each step broadcasts the plan to the other ranks, then runs rank 0's own forward; the collectives inside the
forward keep the ranks in step, and only rank 0 samples. Scheduler and cache manager are unchanged: every rank
allocates a KV pool with the same number of blocks, so a block id means the same slot on every rank.

Placement: with ``WORLD_SIZE``/``RANK`` in the environment (``torchrun``, or ranks started on several machines
with ``python -m ksana.worker.tp_rank``) the standard rendezvous places them; otherwise ksana spawns ranks
1..N-1 on this machine, on a free loopback port.

Failure: a rank that raises reports to the store and exits; a rank that dies closes its sockets. Either way rank
0's pending collective fails at once, and ``execute`` raises ``TPRankError`` naming the rank; the engine stops.
"""

from __future__ import annotations

import datetime
import logging
import os
import subprocess
import sys
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

from ksana.disagg.kv_connector import KVConnector
from ksana.messages import PromptLogprobs, SampledToken, StepPlan, StepTimings
from ksana.models.parallel import CollectiveError, TPGroup, check_tp_size
from ksana.models.shape import ModelShape
from ksana.worker.kv_cache import KVCache
from ksana.worker.model_runner import ModelRunner
from ksana.worker.mtp_drafter import MTPDrafter
from ksana.worker.tp_rank import (
    DEFAULT_TIMEOUT_S,
    ERROR_KEY,
    PARAM_BYTES_KEY,
    KVPairJoin,
    KVSetup,
    RankSetup,
    group_from_env,
    param_bytes,
    run_rank,
)

logger = logging.getLogger(__name__)

_DIAGNOSE_WAIT_S = 5.0  # how long a failure waits for the failing rank's report / exit
_STOP_WAIT_S = 10.0


class TPRankError(RuntimeError):
    """A tensor-parallel rank failed; ``rank`` is the one to blame."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


def read_model_shape(model_dir: Path, dtype: torch.dtype) -> ModelShape:
    from transformers import AutoConfig

    return ModelShape.from_hf_config(AutoConfig.from_pretrained(model_dir), dtype)


def env_world() -> tuple[int, int] | None:
    """``(rank, world_size)`` when the torch.distributed environment places this process, else None."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


class TPModelRunner:
    """Rank 0 of N: build with ``launch``, then ``load_model``, then ``start`` (the KV pool); ``execute`` per step."""

    def __init__(self, group: TPGroup, procs: list[subprocess.Popen], restore_threads: int | None) -> None:
        self.group = group
        self.procs = procs  # ranks 1..N-1 when spawned here; empty when placed by the environment
        self.model: torch.nn.Module | None = None
        self.local: ModelRunner | None = None
        self.failure: BaseException | None = None
        self._restore_threads = restore_threads
        self._finalizer = weakref.finalize(self, _terminate, procs)

    # ---- start-up -----------------------------------------------------------------------------------------------
    @classmethod
    def launch(cls, tp_size: int, model_dir: Path, dtype: torch.dtype, device: torch.device,
               num_threads: int = 0, timeout_s: float = DEFAULT_TIMEOUT_S) -> TPModelRunner:
        """Validate ``tp_size`` for the model, place the ranks, load every rank's shard; rank 0's is ``model``.

        Under a ``torchrun``-style environment a process of rank > 0 serves its rank here and exits.
        """
        check_tp_size(read_model_shape(model_dir, dtype), tp_size)
        from ksana.config import ConfigError

        world = env_world()
        if world is not None and world[1] != tp_size:
            raise ConfigError(f"config key 'setting.global.tensor_para_size' is {tp_size}, but the "
                              f"torch.distributed environment has WORLD_SIZE={world[1]}")
        if world is not None and world[0] != 0:
            run_rank(group_from_env(device.type, timeout_s))
            raise SystemExit(0)
        threads = num_threads or (max(1, (os.cpu_count() or 1) // tp_size) if device.type == "cpu" else 0)
        restore = None
        if device.type == "cpu" and threads:
            restore = torch.get_num_threads()
            torch.set_num_threads(threads)
        if world is not None:
            runner = cls(group_from_env(device.type, timeout_s), [], restore)
        else:
            if device.type == "cuda" and torch.cuda.device_count() < tp_size:
                raise ConfigError(f"config key 'setting.global.tensor_para_size' is {tp_size}, but only "
                                  f"{torch.cuda.device_count()} CUDA devices are visible")
            runner = cls._spawn(tp_size, device, timeout_s, restore)
        try:
            runner._load(model_dir, dtype, threads)
        except BaseException as exc:
            runner._fail(exc)
            raise runner.failure from exc
        return runner

    @classmethod
    def _spawn(cls, tp_size: int, device: torch.device, timeout_s: float,
               restore: int | None) -> TPModelRunner:
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", 0, tp_size, is_master=True, wait_for_workers=False, timeout=timeout)
        procs = []
        for rank in range(1, tp_size):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), WORLD_SIZE=str(tp_size),
                       RANK=str(rank), LOCAL_RANK=str(rank), KSANA_TP_LOOPBACK="1", KSANA_TP_DEVICE=device.type,
                       HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1"))
            procs.append(subprocess.Popen([sys.executable, "-P", "-m", "ksana.worker.tp_rank"], env=env,
                                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
        logger.info("tensor parallelism: spawned ranks 1..%d (pids %s), store on 127.0.0.1:%d",
                    tp_size - 1, [p.pid for p in procs], store.port)
        rank0_device = torch.device("cuda", 0) if device.type == "cuda" else device
        try:
            group = TPGroup(store, 0, tp_size, rank0_device, timeout_s, hostname="127.0.0.1")
        except BaseException:
            _terminate(procs)
            raise
        return cls(group, procs, restore)

    def _load(self, model_dir: Path, dtype: torch.dtype, num_threads: int) -> None:
        from ksana.models.registry import load_model

        dtype_name = str(dtype).removeprefix("torch.")
        self.group.broadcast_object(RankSetup(str(model_dir), dtype_name, self.group.device.type, num_threads))
        self.model = load_model(model_dir, dtype=dtype, device=self.group.device, tp=self.group)

    def start(self, kv_cache: KVCache, mtp_step_num: int = 0) -> TPModelRunner:
        """Every rank allocates a pool of ``kv_cache.num_blocks`` blocks (and the MTP modules' layers when they
        draft); rank 0 runs on ``kv_cache``."""
        try:
            self.group.broadcast_object(KVSetup(kv_cache.num_blocks, kv_cache.block_size, kv_cache.extra_layers,
                                                mtp_step_num))
        except BaseException as exc:
            self._fail(exc)
            raise self.failure from exc
        self.local = ModelRunner(self.model, kv_cache, self.group.device)
        if mtp_step_num:
            self.local.mtp_drafter = MTPDrafter(self.model, kv_cache.layers[self.model.shape.num_layers:],
                                                mtp_step_num, kv_cache.block_size)
            self.local.share_sampled = self.group.broadcast_object
        return self

    # ---- steps --------------------------------------------------------------------------------------------------
    @property
    def kv_cache(self) -> KVCache:
        return self.local.kv_cache

    @property
    def kv_connector(self) -> KVConnector | None:
        return self.local.kv_connector

    @kv_connector.setter
    def kv_connector(self, connector: KVConnector | None) -> None:
        self.local.kv_connector = connector

    def join_pair(self, comm_key: str, comm_id: str) -> None:
        """Every rank joins the pair's KV transport (on the forward's thread, ordered with the steps' broadcasts)."""
        connector = self.local.kv_connector
        try:
            self.group.broadcast_object(KVPairJoin(connector.role, connector.host, connector.expire_s, comm_key,
                                                   comm_id))
        except BaseException as exc:
            self._fail(exc)
            raise self.failure from exc
        connector.connect(comm_key, comm_id)

    @property
    def world_size(self) -> int:
        return self.group.world_size

    def execute(self, plan: StepPlan) -> tuple[dict[str, SampledToken], StepTimings, dict[str, PromptLogprobs]]:
        if self.failure is not None:
            raise self.failure
        try:
            # Only rank 0 samples: the other ranks get its last tokens, for the plan's placeholders.
            previous = self.local.last_sampled if plan.has_placeholders else {}
            self.group.broadcast_object((plan, self.model.layer_forward_round, previous))
            return self.local.execute(plan)
        except BaseException as exc:
            self._fail(exc)
            raise self.failure from exc

    def rank_param_bytes(self) -> list[int]:
        """Parameter bytes each rank holds, as the ranks reported them after loading."""
        others = [int(self.group.store.get(PARAM_BYTES_KEY.format(rank=r))) for r in range(1, self.world_size)]
        return [param_bytes(self.model), *others]

    # ---- failure and shutdown -----------------------------------------------------------------------------------
    def _fail(self, exc: BaseException) -> None:
        """Name the rank to blame, then stop the others (they cannot continue a half-done step)."""
        rank, message = self._diagnose(exc)
        self.failure = TPRankError(rank, message)
        logger.error("%s", message)
        self.close()

    def _diagnose(self, exc: BaseException) -> tuple[int, str]:
        deadline = time.monotonic() + (_DIAGNOSE_WAIT_S if isinstance(exc, CollectiveError) else 0.5)
        while True:
            reports = self._reports()
            errors = {r: m for r, m in reports.items() if m.startswith("error:")}
            dead = {r + 1: p.returncode for r, p in enumerate(self.procs) if p.poll() is not None}
            if errors or (dead and not set(dead) <= set(reports)) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if errors:
            rank = min(errors)
            return rank, f"tensor-parallel rank {rank} failed: {errors[rank].removeprefix('error:')}"
        for rank, code in sorted(dead.items()):
            if rank not in reports:
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                return rank, f"tensor-parallel rank {rank} died: its process {how}"
        if isinstance(exc, CollectiveError):
            others = ", ".join(str(r) for r in range(1, self.world_size))
            return -1, f"tensor-parallel collective failed; one of ranks {others} is unreachable: {exc}"
        return 0, f"tensor-parallel rank 0 failed: {type(exc).__name__}: {exc}"

    def _reports(self) -> dict[int, str]:
        store, reports = self.group.store, {}
        for rank in range(1, self.world_size):
            key = ERROR_KEY.format(rank=rank)
            try:
                if store.check([key]):
                    reports[rank] = store.get(key).decode()
            except Exception:  # a torchrun agent store that went away: nothing to read
                break
        return reports

    def close(self) -> None:
        """Stop the ranks: a clean ``None`` broadcast when healthy, else terminate the spawned processes."""
        if self.failure is None and self.local is not None and all(p.poll() is None for p in self.procs):
            try:
                self.group.broadcast_object(None)
            except Exception:
                pass
        _terminate(self.procs, wait_s=_STOP_WAIT_S if self.failure is None else 0.0)
        if self._restore_threads is not None:
            torch.set_num_threads(self._restore_threads)
            self._restore_threads = None
        if self.failure is None:
            self.failure = TPRankError(0, "tensor-parallel runner is closed")


def _terminate(procs: list[subprocess.Popen], wait_s: float = 0.0) -> None:
    """Wait up to ``wait_s`` for a clean exit, then SIGTERM, then SIGKILL: never leave a rank behind."""
    deadline = time.monotonic() + wait_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
