"""A simulated serving run: the engine's own scheduler and cache manager on a virtual clock, a simulated worker
in the real one's place and the workload replayer in the I/O actor's.

Nothing loads weights: the model's ``config.json`` gives its shape, the configuration the scheduler's settings,
and ``plan_layout`` sizes the KV pool exactly as a real engine would on this machine (with the weights' bytes
taken off the free memory, as they would be once loaded), so preemption happens where it would.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
import trio
import trio.testing
from tqdm.auto import tqdm

from ksana.bench.trace import TraceRequest, check_fits
from ksana.builtin import resolve_model_dir
from ksana.config import ConfigError, KsanaConfig, load_config
from ksana.engine import (
    EngineLayout,
    assemble_loop,
    build_scheduling,
    plan_layout,
    resolve_device,
    resolve_dtype,
)
from ksana.events.clock import VirtualClock
from ksana.events.trace import Trace
from ksana.models.parallel import rank_shape
from ksana.models.shape import ModelShape
from ksana.simulator.fit import LatencyFit, check_identity, load_fit
from ksana.simulator.profile import IDENTITY_KEYS
from ksana.simulator.replay import RequestTimeline, WorkloadReplayer
from ksana.simulator.served_speed import ServedSpeed
from ksana.simulator.worker import SimulatedWorker, SpecAcceptance, StepRecord
from ksana.spec.stats import SpecDecodingStats


@attrs.frozen
class SimulationSetup:
    config: KsanaConfig
    model_dir: Path
    shape: ModelShape
    layout: EngineLayout
    fit: LatencyFit
    spec: SpecAcceptance | None = None  # speculative decoding's acceptance, when the configuration turns it on


@attrs.frozen
class SimulationResult:
    timelines: list[RequestTimeline]
    steps: list[StepRecord]
    wall_s: float  # real seconds the simulation took
    trace: Trace | None
    spec_stats: SpecDecodingStats | None = None


def weight_bytes(model_dir: Path, dtype: torch.dtype) -> int:
    """The weights' size once loaded in ``dtype``, from the safetensors headers (no tensor is read)."""
    from safetensors import safe_open

    element = torch.empty((), dtype=dtype).element_size()
    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as weights:
            for name in weights.keys():  # noqa: SIM118 (safe_open is not a mapping)
                numel = 1
                for size in weights.get_slice(name).get_shape():
                    numel *= size
                total += numel * element
    return total


def prepare(model: str | None, config_path: str | None, overrides: dict[str, Any], profile: str | Path,
            layout_overrides: dict[str, int] | None = None,
            spec_acceptance: tuple[float, ...] = ()) -> SimulationSetup:
    """Everything a simulation needs, checked: the configuration, the model's shape, the KV pool and a fit that
    matches them; with speculative decoding on, the acceptance rate of each draft position (``spec_acceptance``),
    which a simulation cannot know. Raises ``ConfigError``/``ProfileError`` (``ValueError``s) with one-line
    messages."""
    from transformers import AutoConfig

    config = load_config(config_path, model_dir=model, **overrides)
    model_dir = resolve_model_dir(config.model_spec.base_model.model_dir)
    device = resolve_device(config.setting.global_.device)
    dtype = resolve_dtype(config.model_spec.base_model.dtype, device)
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(model_dir), dtype)
    tp_size = config.setting.global_.tensor_para_size
    layout = plan_layout(config, shape, rank_shape(shape, tp_size), device, dtype,
                         unloaded_weight_bytes=weight_bytes(model_dir, dtype),
                         budget_copies=tp_size if device.type == "cpu" else 1)
    if layout_overrides:
        layout = attrs.evolve(layout, **layout_overrides)
    fit = load_fit(profile)
    expected = {key: getattr(shape, key) for key in IDENTITY_KEYS if key != "dtype"}
    expected |= {"dtype": str(dtype).removeprefix("torch."), "device_type": device.type}
    check_identity(fit, expected, str(profile))
    num_drafts = config.scheduler.num_speculative_tokens
    if num_drafts and not spec_acceptance:
        raise ConfigError("speculative decoding is on (mtp_step_num or ngram_step_num): a simulation needs the "
                          "acceptance rate of each draft position (--spec-acceptance, e.g. 0.9,0.8,0.7)")
    if spec_acceptance and not num_drafts:
        raise ConfigError("--spec-acceptance needs speculative decoding on (mtp_step_num or ngram_step_num)")
    spec = SpecAcceptance(num_drafts, tuple(spec_acceptance)) if num_drafts else None
    return SimulationSetup(config, model_dir, shape, layout, fit, spec)


def run_simulation(setup: SimulationSetup, requests: Sequence[TraceRequest], *, seed: int = 0,
                   progress: bool = True, trace_capacity: int = 0, source: str = "trace",
                   speed: ServedSpeed | None = None) -> SimulationResult:
    """Replay ``requests`` through a fresh scheduler and cache manager; returns every request's timeline.
    ``speed``: a served run's speed over time to scale the step prices by (``SimulatedWorker``)."""
    shape, layout = setup.shape, setup.layout
    check_fits(requests, layout.max_token_len, shape.vocab_size, source)
    scheduler, manager = build_scheduling(setup.config, layout)
    eos = tuple(shape.eos_token_ids)
    worker = SimulatedWorker(setup.fit, shape.vocab_size, eos, setup.spec, speed)
    bar = tqdm(total=len(requests), desc="simulating", unit="req", disable=not progress, leave=False)
    replayer = WorkloadReplayer(requests, shape.vocab_size, eos, layout.max_token_len, seed=seed,
                                admission_delay_s=setup.fit.serving_admission_ms / 1000,
                                delivery_s=setup.fit.delivery_s if setup.fit.serving_delivery is not None else None,
                                on_progress=bar.update)
    loop = assemble_loop(scheduler, manager, worker, replayer, VirtualClock(), trace_capacity=trace_capacity)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(loop.run)
            await replayer.all_done.wait()
            loop.shutdown()

    started = time.perf_counter()
    try:
        trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    finally:
        bar.close()
    return SimulationResult(replayer.timelines, worker.steps, time.perf_counter() - started,
                            loop.trace if trace_capacity else None,
                            scheduler.stats.spec if setup.spec is not None else None)
