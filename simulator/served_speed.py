"""How fast a served run's machine was over time: its steps' times against a fit's prices, as curves.

A shared machine's speed is not constant: on a 2-core VM a neighbour's load slows the forward for tens of seconds
at a time, compute-bound prefills more than bandwidth-bound decodes (``bench/simulator_validation.py``'s light
trace: stretches of prefills at 1.5-2.3x their price, decode steps at 1.0-1.4x, while the probe a minute before
ran at 1.0x). No profile measured beforehand can know when that happens. ``ksana simulate validate`` therefore
simulates the trace once more with the fit's prices scaled by the served run's own speed at each moment, one curve
for steps with a prefill and one for decode-only steps (``metrics_with_served_speed``): what is left of the error
then is the simulator's (its scheduler, its model of a step's shape and of the time outside the engine), not the
machine's.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from ksana.simulator.features import StepShape

# Half the window over which the served steps' times are summed against their prices: wide enough to hold a few
# prefills at light load (one every 2 s), narrow enough to follow a slow stretch of tens of seconds.
HALF_WINDOW_S = 6.0
RESOLUTION_S = 0.5


@attrs.frozen
class SpeedCurve:
    """The served steps' time over the fit's prices, ``sum(actual) / sum(price)`` over the steps that started within
    ``HALF_WINDOW_S`` of each of ``times_s`` (seconds from the trace's start); 1.0 is the fit's own speed."""

    times_s: tuple[float, ...]
    factors: tuple[float, ...]

    def __attrs_post_init__(self) -> None:
        if len(self.times_s) != len(self.factors) or not self.times_s:
            raise ValueError("a speed curve needs one factor per time, and at least one")

    def at(self, time_s: float) -> float:
        """The factor at the latest sample time at or before ``time_s`` (the first one before it)."""
        return self.factors[max(0, bisect.bisect_right(self.times_s, time_s) - 1)]


@attrs.frozen
class ServedSpeed:
    """A served run's speed over time, for steps with a prefill and for decode-only steps (None: the run had
    none of that kind, and its steps keep the fit's price)."""

    prefill: SpeedCurve | None
    decode: SpeedCurve | None

    def factor(self, shape: StepShape, time_s: float) -> float:
        curve = self.prefill if shape.num_prefill_rows else self.decode
        return 1.0 if curve is None else curve.at(time_s)

    def to_json(self) -> dict[str, Any]:
        return {kind: None if curve is None else {"times_s": list(curve.times_s), "factors": list(curve.factors)}
                for kind, curve in (("prefill", self.prefill), ("decode", self.decode))}


def served_speed(fit: Any, steps: Sequence[Any], start_s: float) -> ServedSpeed:
    """The speed of ``steps`` (a step log's, each with ``rows``, ``started_at`` and ``duration_s``) against ``fit``'s
    prices, from the trace's start ``start_s`` on the step log's clock."""
    def has_prefill(step: Any) -> bool:
        return StepShape(step.rows).num_prefill_rows > 0

    return ServedSpeed(speed_curve(fit, steps, start_s, has_prefill),
                       speed_curve(fit, steps, start_s, lambda step: not has_prefill(step)))


def speed_curve(fit: Any, steps: Sequence[Any], start_s: float, keep: Callable[[Any], bool],
                resolution_s: float = RESOLUTION_S, half_window_s: float = HALF_WINDOW_S) -> SpeedCurve | None:
    """The ``SpeedCurve`` of the steps ``keep`` takes, sampled every ``resolution_s``; None without such steps. A
    window with none of them keeps the factor before it (a machine that ran none has no speed to measure)."""
    points = sorted((step.started_at - start_s, step.duration_s, fit.worker_s(StepShape(step.rows)))
                    for step in steps if keep(step))
    if not points:
        return None
    starts = [t for t, _, _ in points]
    times, factors, factor = [], [], 1.0
    t = min(0.0, starts[0])
    while t <= starts[-1] + resolution_s:
        window = points[bisect.bisect_left(starts, t - half_window_s):bisect.bisect_right(starts, t + half_window_s)]
        price = sum(p for _, _, p in window)
        if price > 0:
            factor = sum(d for _, d, _ in window) / price
        times.append(t)
        factors.append(factor)
        t += resolution_s
    return SpeedCurve(tuple(times), tuple(factors))
