"""Summary statistics of a metric over the stat rounds (the same set for every metric in the result file)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

STAT_NAMES: tuple[str, ...] = ("mean", "p50", "p90", "p99", "min", "max", "std")


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), ``q`` in [0, 100]."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    rank = (len(sorted_values) - 1) * q / 100.0
    lo, hi = math.floor(rank), math.ceil(rank)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (rank - lo)


def summarize(values: Sequence[float], ndigits: int = 4) -> dict[str, float]:
    """mean, p50, p90, p99, min, max and the population standard deviation (0 for one value)."""
    ordered = sorted(values)
    out = {
        "mean": statistics.fmean(ordered),
        "p50": percentile(ordered, 50),
        "p90": percentile(ordered, 90),
        "p99": percentile(ordered, 99),
        "min": ordered[0],
        "max": ordered[-1],
        "std": statistics.pstdev(ordered),
    }
    return {key: round(value, ndigits) for key, value in out.items()}
