"""Linear step-latency models, fitted by non-negative least squares and judged on held-out batches.

Every feature of a step (``features.py``) costs time, never saves it, so the coefficients are kept non-negative
(NNLS): a fit then extrapolates sanely past the profiled shapes, where an unconstrained fit may trade a negative
term against a positive one. The fit minimises relative error (each sample weighted by one over its latency), so
a 2 ms decode step counts as much as a 500 ms prefill. DistServe's three-term model (a constant, the tokens and
the squared tokens, ordinary least squares) is the baseline every fit reports beside its own error.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import attrs
import numpy as np
from scipy.optimize import nnls

Fitter = Callable[[np.ndarray, np.ndarray], np.ndarray]


@attrs.frozen
class LinearModel:
    """``latency_ms = sum(coef[i] * feature[i])``."""

    features: tuple[str, ...]
    coef: tuple[float, ...]

    def predict(self, x: Sequence[float]) -> float:
        return float(sum(c * v for c, v in zip(self.coef, x, strict=True)))

    def to_json(self) -> dict:
        return {"features": list(self.features), "coef": list(self.coef)}

    @classmethod
    def from_json(cls, data: dict) -> LinearModel:
        return cls(tuple(data["features"]), tuple(float(c) for c in data["coef"]))


@attrs.frozen
class HeldOutError:
    """Relative errors ``|predicted - measured| / measured`` of each sample when its fold was held out."""

    folds: int
    mean: float
    p50: float
    p90: float
    max: float

    def to_json(self) -> dict:
        return attrs.asdict(self)


def nnls_relative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative coefficients minimising the squared relative error."""
    weights = 1.0 / np.maximum(y, 1e-9)
    coef, _residual = nnls(x * weights[:, None], y * weights)
    return coef


def nnls_absolute(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative coefficients minimising the squared error itself: for delays that may be near zero, where a
    relative error means nothing."""
    coef, _residual = nnls(x, y)
    return coef


def ols_relative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Unconstrained least squares on the same relative error (the baseline's fit)."""
    weights = 1.0 / np.maximum(y, 1e-9)
    coef, *_ = np.linalg.lstsq(x * weights[:, None], y * weights, rcond=None)
    return coef


def fit(features: Sequence[str], x: Sequence[Sequence[float]], y: Sequence[float],
        fitter: Fitter = nnls_relative) -> LinearModel:
    coef = fitter(np.asarray(x, dtype=float), np.asarray(y, dtype=float))
    return LinearModel(tuple(features), tuple(float(c) for c in coef))


def held_out_error(x: Sequence[Sequence[float]], y: Sequence[float], fitter: Fitter = nnls_relative,
                   folds: int = 5, seed: int = 0) -> HeldOutError:
    """k-fold cross-validation: each sample predicted by a fit that never saw it (folds drawn at random, seeded)."""
    xs, ys = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    n = len(ys)
    folds = max(2, min(folds, n))
    order = list(range(n))
    random.Random(seed).shuffle(order)
    errors = np.empty(n)
    for k in range(folds):
        held = order[k::folds]
        kept = [i for i in order if i not in set(held)]
        coef = fitter(xs[kept], ys[kept])
        errors[held] = np.abs(xs[held] @ coef - ys[held]) / np.maximum(ys[held], 1e-9)
    return HeldOutError(folds=folds, mean=float(errors.mean()), p50=float(np.percentile(errors, 50)),
                        p90=float(np.percentile(errors, 90)), max=float(errors.max()))
