"""Latency fits with known coefficients, so simulated times can be checked by hand."""

from __future__ import annotations

from pathlib import Path

from ksana.simulator.features import BASELINE_FEATURES, FEATURES
from ksana.simulator.fit import FittedModel, LatencyFit
from ksana.simulator.latency_model import HeldOutError, LinearModel

EXACT = HeldOutError(folds=5, mean=0.0, p50=0.0, p90=0.0, max=0.0)


def linear_fit(identity: dict, *, const_ms: float = 10.0, prefill_token_ms: float = 0.1,
               decode_row_ms: float = 0.0, engine_ms: float = 0.0, serving_worker: LinearModel | None = None,
               serving_admission_ms: float = 0.0, serving_delivery: LinearModel | None = None) -> LatencyFit:
    """Worker: ``const_ms + prefill_token_ms * prefill tokens + decode_row_ms * decode rows``; engine: a constant."""
    worker = LinearModel(FEATURES, (const_ms, prefill_token_ms, 0.0, decode_row_ms, 0.0, 0.0, 0.0))
    engine = LinearModel(FEATURES, (engine_ms, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0))
    baseline = LinearModel(BASELINE_FEATURES, (const_ms, prefill_token_ms, 0.0))
    return LatencyFit(identity=identity, provenance={}, worker=FittedModel(worker, EXACT),
                      engine=FittedModel(engine, EXACT), baseline=FittedModel(baseline, EXACT), groups={},
                      serving_worker=FittedModel(serving_worker, EXACT) if serving_worker is not None else None,
                      serving_admission_ms=serving_admission_ms, serving_delivery=serving_delivery)


def demo_identity(folder: Path) -> dict:
    """The demo model's identity as a fit records it (float32 on the CPU): its shape, read by ``prepare``."""
    from ksana.simulator.simulate import prepare

    linear_fit({}).save(folder / "blank.json")
    shape = prepare("demo", None, {}, folder / "blank.json").shape
    keys = ("model_type", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
            "vocab_size")
    return {key: getattr(shape, key) for key in keys} | {"dtype": "float32", "device_type": "cpu"}
