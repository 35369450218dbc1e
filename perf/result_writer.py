"""The perf result file (``model_perf_result.json``, schema in ``docs/perf_result.md``): metadata that ties a
simulator fit to what produced it, then per batch its shape, every stat round and the statistics over them."""

from __future__ import annotations

import datetime as dt
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import torch
import trio

import ksana
from ksana.models.shape import ModelShape
from ksana.perf.backend import TIMING_FIELDS, BatchResult, RoundMetrics
from ksana.perf.operator_profiler import OPERATORS, OperatorTimes
from ksana.perf.stats import summarize

SCHEMA_VERSION = 1
NDIGITS = 4  # milliseconds to 0.1 microsecond


def _r(value: float) -> float:
    return round(value, NDIGITS)


def git_commit(repo_dir: Path) -> tuple[str | None, bool | None]:
    """``(commit, dirty)`` of the checkout holding the code, or ``(None, None)`` without git or commits."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo_dir, capture_output=True, text=True,
                                timeout=10)
        if commit.returncode != 0:
            return None, None
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo_dir,
                                capture_output=True, text=True, timeout=10)
        dirty = bool(status.stdout.strip()) if status.returncode == 0 else None
        return commit.stdout.strip(), dirty
    except (OSError, subprocess.SubprocessError):
        return None, None


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_info(device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {"type": "cuda", "name": props.name, "index": device.index or 0,
                "memory_bytes": int(props.total_memory), "num_threads": torch.get_num_threads()}
    return {"type": device.type, "name": cpu_name(), "index": None, "memory_bytes": None,
            "num_threads": torch.get_num_threads()}


def kernels_info(device: torch.device) -> dict[str, Any]:
    """Which kernels ran: the ``KernelOps`` set, and on the CPU the native build's instruction set. Part of a
    profile's identity: the simulator refuses to mix latencies of different kernels."""
    from ksana.kernels.dispatch import get_ops

    ops = get_ops(device)
    info: dict[str, Any] = {"ops": ops.name}
    if ops.name == "cpu-native":
        from ksana.kernels.cpu.build import build_level

        info["cpu_build"] = build_level()
    return info


def model_info(model_dir: Path, shape: ModelShape, num_parameters: int) -> dict[str, Any]:
    return {
        "model_dir": str(model_dir),
        "model_type": shape.model_type,
        "hidden_size": shape.hidden_size,
        "num_layers": shape.num_layers,
        "num_heads": shape.num_heads,
        "num_kv_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "intermediate_size": shape.intermediate_size,
        "vocab_size": shape.vocab_size,
        "max_position_embeddings": shape.max_position_embeddings,
        "dtype": str(shape.dtype).removeprefix("torch."),
        "num_parameters": num_parameters,
    }


def environment_info() -> dict[str, Any]:
    """Versions, git commit and host: what a result must carry to be compared with another."""
    commit, dirty = git_commit(Path(ksana.__file__).resolve().parent.parent)
    return {
        "versions": {"ksana": ksana.__version__, "torch": torch.__version__, "trio": trio.__version__,
                     "python": platform.python_version()},
        "git_commit": commit,
        "git_dirty": dirty,
        "host": {"hostname": socket.gethostname(), "platform": platform.platform(), "cpu": cpu_name(),
                 "num_cpus": os.cpu_count()},
        "command": list(sys.argv),
    }


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def operators_json(ops: OperatorTimes) -> dict[str, Any]:
    return {
        name: {
            "total_ms": _r(ops.total_s(name) * 1000),
            "calls": ops.calls[name],
            "per_layer_ms": [_r(s * 1000) for s in ops.per_layer_s[name]],
            "outside_layers_ms": _r(ops.outside_layers_s[name] * 1000),
        }
        for name in OPERATORS
    }


def round_json(m: RoundMetrics) -> dict[str, Any]:
    out: dict[str, Any] = {"round": m.index}
    out.update({name: _r(getattr(m, name)) for name in TIMING_FIELDS})
    out["num_scheduled_requests"] = m.num_scheduled_requests
    out["num_scheduled_tokens"] = m.num_scheduled_tokens
    ops = m.operators
    out["operator_sum_ms"] = None if ops is None else _r(ops.forward_total_s * 1000)
    out["operator_span_ms"] = None if ops is None else _r(ops.span_s * 1000)
    out["operators"] = None if ops is None else operators_json(ops)
    return out


def _operator_stats(rounds: tuple[RoundMetrics, ...], num_layers: int) -> dict[str, Any]:
    ops = [m.operators for m in rounds]
    n = len(ops)
    return {
        name: {
            "calls": ops[0].calls[name],
            "total_ms": summarize([o.total_s(name) * 1000 for o in ops], NDIGITS),
            "per_layer_ms": [_r(sum(o.per_layer_s[name][i] for o in ops) * 1000 / n) for i in range(num_layers)],
            "outside_layers_ms": _r(sum(o.outside_layers_s[name] for o in ops) * 1000 / n),
        }
        for name in OPERATORS
    }


def batch_json(result: BatchResult, block_size: int, num_layers: int) -> dict[str, Any]:
    b, rounds = result.batch, result.rounds
    stats = {name: summarize([getattr(m, name) for m in rounds], NDIGITS) for name in TIMING_FIELDS}
    profiled = rounds[0].operators is not None
    if profiled:
        stats["operator_sum_ms"] = summarize([m.operators.forward_total_s * 1000 for m in rounds], NDIGITS)
        stats["operator_span_ms"] = summarize([m.operators.span_s * 1000 for m in rounds], NDIGITS)
    return {
        "name": b.name,
        "requests": [spec.to_json() for spec in b.requests],
        "num_requests": b.num_requests,
        "num_prefill_requests": b.num_prefill_requests,
        "num_decode_requests": b.num_decode_requests,
        "num_tokens": b.num_tokens,
        "num_prefill_tokens": b.num_prefill_tokens,
        "num_decode_tokens": b.num_decode_tokens,
        "total_sequence_len": b.total_sequence_len,
        "num_cached_tokens": b.num_cached_tokens,
        "num_kv_blocks": b.num_blocks(block_size),
        "num_warmup_rounds": result.num_warmup_rounds,
        "num_stat_rounds": len(rounds),
        "rounds": [round_json(m) for m in rounds],
        "stats": stats,
        "operators": _operator_stats(rounds, num_layers) if profiled else None,
    }


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(obj, option=orjson.OPT_INDENT_2) + b"\n")
