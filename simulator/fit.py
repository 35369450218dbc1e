"""A fitted latency profile: what one step of a plan costs on the worker and around it in the engine.

``fit_profile`` fits the worker's time and the engine's time per step from perf results, each with its held-out
error and DistServe's baseline beside it, plus one model per operator group where the profile timed operators.
The fit is saved as JSON with its profile's identity (model shape, dtype, device, threads, kernel build) and
provenance (commit, files); simulating an engine of another identity with it is an error.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import orjson

from ksana.scheduler.step_log import LoggedStep
from ksana.simulator.features import BASELINE_FEATURES, FEATURES, StepShape, feature_matrix
from ksana.simulator.latency_model import (
    HeldOutError,
    LinearModel,
    fit,
    held_out_error,
    ols_relative,
)
from ksana.simulator.profile import OPERATOR_GROUPS, Profile, ProfileError, load_profile, read_json

FIT_FORMAT = "ksana-latency-fit"
FIT_VERSION = 2
# A token's delivery to its client (``LatencyFit.serving_delivery``): a constant and the step's rows.
DELIVERY_FEATURES = ("const", "rows")


@attrs.frozen
class FittedModel:
    model: LinearModel
    held_out: HeldOutError

    def to_json(self) -> dict:
        return {**self.model.to_json(), "held_out_rel_error": self.held_out.to_json()}


@attrs.frozen
class LatencyFit:
    identity: dict[str, Any]
    provenance: dict[str, Any]
    worker: FittedModel
    engine: FittedModel
    baseline: FittedModel  # DistServe's three terms on the worker's time, for comparison
    groups: dict[str, FittedModel]
    # The worker's time per step as a server measured it (``ksana simulate calibrate``, from ``ksana serve
    # --step-log``): serving runs the streams' events, HTTP and its clients on the forward's cores, and keeps the
    # forward warm between steps, so its steps cost other than perf mode's; when present it prices the steps.
    serving_worker: FittedModel | None = None
    # A request's time outside the engine as a server measured it (``ksana.simulator.calibrate``): from its
    # arrival until the scheduler has it, and from a step's result until a client reads the step's token: its mean
    # in ms is ``const + per_row * rows`` of the step (``DELIVERY_FEATURES``).
    serving_admission_ms: float = 0.0
    serving_delivery: LinearModel | None = None
    calibration: dict[str, Any] | None = None

    def worker_s(self, shape: StepShape) -> float:
        model = self.serving_worker if self.serving_worker is not None else self.worker
        return max(0.0, model.model.predict(shape.features())) / 1000

    def engine_s(self, shape: StepShape) -> float:
        return max(0.0, self.engine.model.predict(shape.features())) / 1000

    def delivery_s(self, num_rows: int, position: float = 0.5) -> float:
        """How long after a step's result one of its tokens reaches its client: a step hands its tokens out over a
        window that grows with its rows, ``per_row * rows`` on average, twice that at most; ``position`` in
        [0, 1) is where in the window this token falls (0.5: the mean)."""
        if self.serving_delivery is None:
            return 0.0
        const, per_row = self.serving_delivery.coef
        return max(0.0, const + 2 * position * per_row * num_rows) / 1000

    def to_json(self) -> dict[str, Any]:
        return {"format": FIT_FORMAT, "version": FIT_VERSION, "identity": self.identity,
                "provenance": self.provenance, "worker_ms": self.worker.to_json(),
                "engine_ms": self.engine.to_json(), "baseline_worker_ms": self.baseline.to_json(),
                "groups_ms": {name: model.to_json() for name, model in self.groups.items()},
                "serving_worker_ms": self.serving_worker.to_json() if self.serving_worker is not None else None,
                "serving_admission_ms": self.serving_admission_ms,
                "serving_delivery_ms": self.serving_delivery.to_json() if self.serving_delivery is not None else None,
                "calibration": self.calibration}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(orjson.dumps(self.to_json(), option=orjson.OPT_INDENT_2) + b"\n")
        return path

    @classmethod
    def from_json(cls, data: dict[str, Any], source: str = "fit") -> LatencyFit:
        if data.get("format") != FIT_FORMAT:
            raise ProfileError(f"{source}: not a latency fit (format {data.get('format')!r})")
        try:
            return cls(identity=data["identity"], provenance=data["provenance"],
                       worker=_fitted(data["worker_ms"]), engine=_fitted(data["engine_ms"]),
                       baseline=_fitted(data["baseline_worker_ms"]),
                       groups={name: _fitted(g) for name, g in data["groups_ms"].items()},
                       serving_worker=_fitted(data["serving_worker_ms"]) if data.get("serving_worker_ms") else None,
                       **_serving_delays(data), calibration=data.get("calibration"))
        except (KeyError, TypeError) as error:
            raise ProfileError(f"{source}: malformed latency fit: missing {error}") from None


def _serving_delays(data: dict[str, Any]) -> dict[str, Any]:
    """The admission and delivery of a saved fit. A version-1 fit has one ``serving_request_ms`` for both sides,
    measured as a client's TTFT less the engine's: it is read as a constant delivery, the side it mostly is."""
    if data.get("version", FIT_VERSION) < 2:
        request_ms = float(data.get("serving_request_ms", 0.0))
        return {"serving_admission_ms": 0.0,
                "serving_delivery": LinearModel(DELIVERY_FEATURES, (request_ms, 0.0)) if request_ms else None}
    delivery = data.get("serving_delivery_ms")
    return {"serving_admission_ms": float(data.get("serving_admission_ms", 0.0)),
            "serving_delivery": LinearModel.from_json(delivery) if delivery else None}


def _fitted(data: dict[str, Any]) -> FittedModel:
    return FittedModel(LinearModel.from_json(data), HeldOutError(**data["held_out_rel_error"]))


def _fit_one(x: list, y: list[float], features: Sequence[str], fitter=None) -> FittedModel:
    kwargs = {} if fitter is None else {"fitter": fitter}
    return FittedModel(fit(features, x, y, **kwargs), held_out_error(x, y, **kwargs))


def fit_profile(profile: Profile) -> LatencyFit:
    samples = profile.samples
    shapes = [s.shape for s in samples]
    x = feature_matrix(shapes)
    groups = {}
    if all(s.groups_ms is not None for s in samples):
        groups = {name: _fit_one(x, [s.groups_ms[name] for s in samples], FEATURES) for name in OPERATOR_GROUPS
                  if any(s.groups_ms[name] > 0 for s in samples)}
    meta = profile.meta
    provenance = {"files": [str(p) for p in profile.paths], "num_samples": len(samples),
                  "git_commit": meta.get("git_commit"), "versions": meta.get("versions"),
                  "runtime": meta.get("runtime"), "profile_operators": meta.get("profile_operators")}
    return LatencyFit(
        identity=profile.identity,
        provenance=provenance,
        worker=_fit_one(x, [s.worker_ms for s in samples], FEATURES),
        engine=_fit_one(x, [s.engine_ms for s in samples], FEATURES),
        baseline=_fit_one(feature_matrix(shapes, baseline=True), [s.worker_ms for s in samples],
                          BASELINE_FEATURES, fitter=ols_relative),
        groups=groups,
    )


def fit_steps(shapes: Sequence[StepShape], worker_ms: Sequence[float]) -> FittedModel:
    """The worker's time per step fitted on steps a server ran (the step log's), with its held-out error."""
    return _fit_one(feature_matrix(shapes), list(worker_ms), FEATURES)


def fit_logged_steps(steps: Sequence[LoggedStep]) -> FittedModel:
    """The worker's time per step fitted on steps from ``ksana serve --step-log``."""
    return fit_steps([StepShape(step.rows) for step in steps], [step.duration_s * 1000 for step in steps])


def load_fit(path: str | Path) -> LatencyFit:
    """A saved fit, or a raw perf result (fitted on the fly)."""
    path = Path(path)
    data = read_json(path)
    if isinstance(data, dict) and data.get("format") == FIT_FORMAT:
        return LatencyFit.from_json(data, str(path))
    return fit_profile(load_profile([path]))


def check_identity(fit_: LatencyFit, expected: dict[str, Any], source: str) -> None:
    """Refuse a fit made for another model shape, dtype or device than the engine being simulated."""
    wrong = {key: (fit_.identity.get(key), value) for key, value in expected.items()
             if value is not None and fit_.identity.get(key) is not None and fit_.identity.get(key) != value}
    if wrong:
        detail = ", ".join(f"{key}: profile {had!r}, engine {want!r}" for key, (had, want) in wrong.items())
        raise ProfileError(f"{source}: profiled for another configuration ({detail})")
