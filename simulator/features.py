"""A step's shape as the latency model sees it: the same features from a perf batch and from a live plan.

A step is a set of rows; each row computes ``q`` new tokens of a sequence whose context is ``c`` tokens once the
step has run. Rows with ``q == 1`` are decodes, the others prefills (or prefill chunks over a cached prefix). The
features are what the work scales with:

- ``prefill_tokens``: sum of ``q`` over prefill rows (every projection and MLP runs once per token);
- ``prefill_attention``: (query, key) pairs of the prefills' causal attention, ``q * c - q * (q - 1) / 2`` a row;
- ``decode_rows``: decode rows (a decode step's matmuls stream the weights once, whatever the rows);
- ``decode_rows_squared``: its square, the convex bend where a decode step's matmuls turn from reading the weights
  to computing with them (a 5.7% -> 3.7% mean held-out error for ``smollm2`` on a 2-core CPU,
  ``ksana simulate fit`` on ``ksana simulate sweep``'s batches);
- ``decode_context``: sum of ``c`` over decode rows (decode attention reads every cached key and value);
- ``rows``: every row (the lm_head and the sampler run once a row).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from ksana.messages import StepPlan

FEATURES: tuple[str, ...] = ("const", "prefill_tokens", "prefill_attention", "decode_rows", "decode_rows_squared",
                             "decode_context", "rows")


@attrs.frozen
class StepShape:
    """``rows``: one ``(new_tokens, context_after_step)`` pair per scheduled sequence."""

    rows: tuple[tuple[int, int], ...]

    @classmethod
    def from_plan(cls, plan: StepPlan) -> StepShape:
        return cls(tuple((row.num_new_tokens, row.seq_len) for row in plan.rows))

    @classmethod
    def from_perf_requests(cls, requests: Iterable[Mapping[str, Any]]) -> StepShape:
        """A perf batch's ``dp_0`` entries (``forwarding_token_num``, ``sequence_len``, ``request_num``)."""
        rows = []
        for entry in requests:
            rows += [(int(entry["forwarding_token_num"]), int(entry["sequence_len"]))] * int(entry.get("request_num", 1))
        return cls(tuple(rows))

    @property
    def num_tokens(self) -> int:
        return sum(q for q, _ in self.rows)

    @property
    def num_prefill_rows(self) -> int:
        """Rows that compute more than one token: prompts or their chunks."""
        return sum(1 for q, _ in self.rows if q > 1)

    def features(self) -> tuple[float, ...]:
        prefill_tokens = prefill_attention = decode_rows = decode_context = 0
        for q, c in self.rows:
            if q == 1:
                decode_rows += 1
                decode_context += c
            else:
                prefill_tokens += q
                prefill_attention += q * c - q * (q - 1) // 2
        return (1.0, float(prefill_tokens), float(prefill_attention), float(decode_rows),
                float(decode_rows * decode_rows), float(decode_context), float(len(self.rows)))

    def baseline_features(self) -> tuple[float, ...]:
        """DistServe's three terms: a constant, the tokens, and the sum of squared new tokens (its prefill model's
        quadratic attention term)."""
        return (1.0, float(self.num_tokens), float(sum(q * q for q, _ in self.rows)))


BASELINE_FEATURES: tuple[str, ...] = ("const", "tokens", "tokens_squared")


def feature_matrix(shapes: Sequence[StepShape], baseline: bool = False) -> list[tuple[float, ...]]:
    return [shape.baseline_features() if baseline else shape.features() for shape in shapes]
