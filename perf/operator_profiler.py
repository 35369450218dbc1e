"""Operator-level timing of the model forward: the timer that ``KernelOps.timed`` wraps every op with.

On CUDA each call is bracketed by two CUDA events (read after one synchronize when the step is over, so the
forward is never serialised by the profiler); elsewhere by wall time, which is the op's own time because CPU ops
return only when done (other accelerators are synchronised around each op). The model sets ``layer`` to the
decoder layer running, so times come out per layer and summed.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import attrs
import torch

# Every operator a step can report, in forward order. ``sampler`` comes from the model runner's own timing;
# ``all_reduce`` is the tensor-parallel slot (after o_proj and mlp_down); 0 calls when tensor_para_size is 1.
OPERATORS: tuple[str, ...] = (
    "embedding",
    "rotary",
    "norm",
    "qkv_proj",
    "kv_cache_store",
    "attention_prefill",
    "attention_decode",
    "o_proj",
    "mlp_gate_up",
    "mlp_act",
    "mlp_down",
    "all_reduce",
    "lm_head",
    "sampler",
)
FORWARD_OPERATORS: tuple[str, ...] = tuple(name for name in OPERATORS if name != "sampler")


@attrs.frozen
class OperatorTimes:
    """One step's operator times in seconds: per layer, outside the layers (embedding, final norm, lm_head),
    call counts, and the span from the first op's start to the last op's end."""

    num_layers: int
    per_layer_s: dict[str, list[float]]
    outside_layers_s: dict[str, float]
    calls: dict[str, int]
    span_s: float

    def total_s(self, name: str) -> float:
        return sum(self.per_layer_s[name]) + self.outside_layers_s[name]

    @property
    def forward_total_s(self) -> float:
        """Sum over the forward's operators (everything but the sampler)."""
        return sum(self.total_s(name) for name in FORWARD_OPERATORS)

    def with_sampler(self, sample_s: float) -> OperatorTimes:
        """The sampler runs in the model runner, which times it itself; add it as one call outside the layers."""
        return attrs.evolve(
            self,
            outside_layers_s={**self.outside_layers_s, "sampler": sample_s},
            calls={**self.calls, "sampler": 1},
        )


class OperatorProfiler:
    """Collects one record per op call; ``take()`` turns the records of the step just run into times.

    The worker thread appends while the step runs and the perf backend calls ``take()`` once the step's result
    is back, so the two never overlap.
    """

    def __init__(self, device: torch.device | str, num_layers: int) -> None:
        self.device = torch.device(device)
        self.num_layers = num_layers
        self.layer: int | None = None
        self.uses_cuda_events = self.device.type == "cuda"
        sync = None if self.device.type in ("cpu", "cuda") else getattr(torch, self.device.type, None)
        self._synchronize: Callable[[], None] | None = getattr(sync, "synchronize", None)
        self._records: list[tuple[str, int | None, object, object]] = []

    @property
    def timing_method(self) -> str:
        return "cuda_events" if self.uses_cuda_events else "synchronized_wall_clock"

    def wrap(self, name: str, fn: Callable) -> Callable:
        if name not in OPERATORS:
            raise ValueError(f"unknown operator {name!r}; known: {', '.join(OPERATORS)}")
        records = self._records
        if self.uses_cuda_events:
            event = torch.cuda.Event

            def timed_cuda(*args, **kwargs):
                start, end = event(enable_timing=True), event(enable_timing=True)
                start.record()
                out = fn(*args, **kwargs)
                end.record()
                records.append((name, self.layer, start, end))
                return out

            return timed_cuda
        clock, synchronize = time.perf_counter, self._synchronize

        def timed(*args, **kwargs):
            if synchronize is not None:
                synchronize()
            start = clock()
            out = fn(*args, **kwargs)
            if synchronize is not None:
                synchronize()
            records.append((name, self.layer, start, clock()))
            return out

        return timed

    def reset(self) -> None:
        self._records.clear()

    def take(self) -> OperatorTimes:
        """The times of every op recorded since the last ``take``/``reset``; clears the records."""
        records, self._records[:] = list(self._records), []
        if self.uses_cuda_events and records:
            torch.cuda.synchronize(self.device)
            durations = [start.elapsed_time(end) / 1000.0 for _, _, start, end in records]
            span = records[0][2].elapsed_time(records[-1][3]) / 1000.0
        else:
            durations = [end - start for _, _, start, end in records]
            span = records[-1][3] - records[0][2] if records else 0.0
        per_layer = {name: [0.0] * self.num_layers for name in OPERATORS}
        outside = dict.fromkeys(OPERATORS, 0.0)
        calls = dict.fromkeys(OPERATORS, 0)
        for (name, layer, _, _), seconds in zip(records, durations, strict=True):
            calls[name] += 1
            if layer is None:
                outside[name] += seconds
            else:
                per_layer[name][layer] += seconds
        return OperatorTimes(self.num_layers, per_layer, outside, calls, span)
