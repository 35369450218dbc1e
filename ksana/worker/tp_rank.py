"""A tensor-parallel rank other than 0: loads its shard, then runs every step plan rank 0 broadcasts.

Placed by the standard torch.distributed environment (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``,
``RANK``; ``LOCAL_RANK`` picks the GPU): ``python -m ksana.worker.tp_rank`` on another machine, a ``torchrun``
launch of any ``ksana`` command (ranks > 0 end up here), or ksana itself spawning ranks on one machine
(``KSANA_TP_LOOPBACK=1``: the store is rank 0's, on loopback).

Rank 0 drives: it broadcasts the load setup, the KV pool size, then ``(plan, layer_forward_round)`` per step (and
a ``KVPairJoin`` when a prefill or decode node joins a pair) and ``None`` to stop. A rank that fails writes its error to the store under ``ksana/tp/error/<rank>`` and exits;
its closed sockets make rank 0's pending collective fail at once, and rank 0 names the rank from the store.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import traceback

import attrs
import torch
import torch.distributed as dist

from ksana.models.parallel import CollectiveError, TPGroup

logger = logging.getLogger(__name__)

# Test hook: "RANK:STEP" makes that rank raise at its STEP-th step (1-based), to test failure reporting.
FAIL_ENV = "KSANA_TP_FAIL_AT_STEP"
ERROR_KEY = "ksana/tp/error/{rank}"
PARAM_BYTES_KEY = "ksana/tp/param_bytes/{rank}"
DEFAULT_TIMEOUT_S = 600.0


@attrs.frozen
class RankSetup:
    """What rank 0 tells every rank to load (so remote ranks need only the torch.distributed environment)."""

    model_dir: str
    dtype: str  # "float32", "bfloat16", "float16"
    device_type: str  # "cpu", "cuda"
    num_threads: int  # torch intra-op threads on CPU; 0 keeps torch's default


@attrs.frozen
class KVSetup:
    num_blocks: int
    block_size: int
    extra_layers: int = 0  # the MTP modules' cache layers
    mtp_step_num: int = 0  # > 0: the MTP modules draft, on every rank (their forward has collectives)


@attrs.frozen
class KVPairJoin:
    """Prefill/decode disaggregation: join a pair's KV transport (each rank sends or receives its own KV heads);
    the first one also gives the rank its connector."""

    role: str
    host: str
    expire_s: float
    comm_key: str
    comm_id: str


def rank_device(device_type: str, rank: int) -> torch.device:
    if device_type == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    return torch.device(device_type)


def param_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters this process holds (a tied lm_head counts once)."""
    seen, total = set(), 0
    for tensor in model.parameters():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total


def _fail_step(rank: int) -> int | None:
    value = os.environ.get(FAIL_ENV, "")
    if ":" not in value:
        return None
    fail_rank, step = value.split(":", 1)
    return int(step) if int(fail_rank) == rank else None


def run_rank(group: TPGroup) -> None:
    """Serve rank 0's broadcasts until it says stop; on any error, report it to the store and re-raise."""
    from ksana.disagg.kv_connector import KVConnector
    from ksana.models.registry import load_model
    from ksana.worker.kv_cache import KVCache
    from ksana.worker.model_runner import ModelRunner
    from ksana.worker.mtp_drafter import MTPDrafter

    # The class as rank 0 pickles it (this module may be running as ``__main__``, a module of another name).
    from ksana.worker.tp_rank import KVPairJoin as PairJoin

    class _RankRunner(ModelRunner):
        def sample(self, logits, rows, previous=None):  # rank 0 samples; the others only take part in the collectives
            return {}

    rank = group.rank
    try:
        setup: RankSetup = group.broadcast_object()
        if setup.device_type == "cpu" and setup.num_threads > 0:
            torch.set_num_threads(setup.num_threads)
        dtype = getattr(torch, setup.dtype)
        model = load_model(setup.model_dir, dtype=dtype, device=group.device, tp=group)
        group.store.set(PARAM_BYTES_KEY.format(rank=rank), str(param_bytes(model)))
        kv: KVSetup = group.broadcast_object()
        kv_cache = KVCache.allocate(model.rank_shape, kv.num_blocks, kv.block_size, dtype, group.device,
                                    head_major=model.kv_head_major, extra_layers=kv.extra_layers)
        runner = _RankRunner(model, kv_cache, group.device)
        if kv.mtp_step_num:
            runner.mtp_drafter = MTPDrafter(model, kv_cache.layers[model.shape.num_layers:], kv.mtp_step_num,
                                            kv.block_size)
            runner.share_sampled = lambda _: group.broadcast_object()  # rank 0's tokens
        fail_at, num_steps = _fail_step(rank), 0
        while (message := group.broadcast_object()) is not None:
            if isinstance(message, PairJoin):
                if runner.kv_connector is None:
                    runner.kv_connector = KVConnector(message.role, message.host, message.expire_s, tp_rank=rank,
                                                      tp_size=group.world_size)
                    runner.kv_connector.expected_bytes = kv_cache.payload_bytes
                runner.kv_connector.connect(message.comm_key, message.comm_id)
                continue
            plan, layer_forward_round, runner.last_sampled = message
            num_steps += 1
            if num_steps == fail_at:
                raise RuntimeError(f"injected failure at step {num_steps} ({FAIL_ENV})")
            model.set_layer_forward_round(layer_forward_round)
            runner.execute(plan)
    except BaseException as exc:
        kind = "collective" if isinstance(exc, CollectiveError) else "error"
        detail = "".join(traceback.format_exception_only(exc)).strip()
        try:
            group.store.set(ERROR_KEY.format(rank=rank), f"{kind}:{detail}")
        except Exception:  # the store lives in rank 0's process; if that is gone there is no one to tell
            pass
        raise


def group_from_env(device_type: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> TPGroup:
    """This process's group from the torch.distributed environment (torchrun's agent store included)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if os.environ.get("KSANA_TP_LOOPBACK") == "1":
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                              is_master=False, timeout=timeout)
        hostname = "127.0.0.1"
    else:
        store, rank, world_size = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
        hostname = None
    device_type = device_type or os.environ.get("KSANA_TP_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    return TPGroup(store, rank, world_size, rank_device(device_type, rank), timeout_s, hostname=hostname)


def main() -> int:
    logging.basicConfig(level=os.environ.get("KSANA_LOG_LEVEL", "WARNING"),
                        format=f"%(asctime)s tp-rank-{os.environ.get('RANK')} %(levelname)s %(name)s: %(message)s")
    group = group_from_env()
    try:
        run_rank(group)
    except BaseException as exc:
        if not isinstance(exc, CollectiveError):
            traceback.print_exc()
        else:
            print(f"ksana tp rank {group.rank}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    # os._exit: skip interpreter teardown, which may wait on a process group whose peers are gone.
    sys.stdout.flush()
    code = main()
    sys.stderr.flush()
    os._exit(code)
