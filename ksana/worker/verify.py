"""Verifying drafts: a verify row is sampled at each of its positions, and its drafts accepted while they match.

Every drafter here proposes deterministic tokens (a draft distribution that puts all its mass on one token), and
for such drafts the rejection-sampling rule of speculative sampling (accept draft ``d`` with probability
``min(1, p(d) / q(d)) = p(d)``; on rejection draw from ``p`` without ``d``) is the same as drawing from ``p`` at
each position and accepting while the draw equals the draft: the first draw that differs is distributed as ``p``
given "not ``d``". So the output distribution is the target model's, and greedy output is the output without
speculation, token for token. Position ``j`` of a row samples as the non-speculative step for that output index
would (its generator seeded by ``(seed, num_output_tokens + j)``, penalties over the outputs and drafts before it,
``min_tokens`` bans while the count is short), so a seeded request gets the very tokens it would get without
speculation too.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from ksana.messages import SampledToken, ScheduledRow
from ksana.worker.sampler import SamplingRow


def position_rows(row: ScheduledRow, sampling_row: SamplingRow) -> list[SamplingRow]:
    """The sampling rows of a row's sampled positions: one, or ``1 + num_draft_tokens`` for a verify row."""
    drafts = row.draft_token_ids if row.num_draft_tokens else ()
    if not drafts:
        return [sampling_row]
    params, outputs = sampling_row.params, sampling_row.output_token_ids
    return [
        attrs.evolve(
            sampling_row,
            num_output_tokens=sampling_row.num_output_tokens + j,
            output_token_ids=[*outputs, *drafts[:j]] if params.has_penalties else outputs,
            banned_token_ids=(sampling_row.banned_token_ids
                              if sampling_row.num_output_tokens + j < params.min_tokens else ()),
        )
        for j in range(len(drafts) + 1)
    ]


def accept_drafts(rows: Sequence[ScheduledRow], tokens: Sequence[SampledToken]) -> dict[str, SampledToken]:
    """Each row's result from the tokens of its sampled positions (``tokens``, in row order, ``1 +
    num_draft_tokens`` per row): a verify row's first token carries the later ones it accepts in ``following``."""
    out: dict[str, SampledToken] = {}
    offset = 0
    for row in rows:
        drafts = row.draft_token_ids if row.num_draft_tokens else ()
        first = tokens[offset]
        num_accepted = 0
        while num_accepted < len(drafts) and tokens[offset + num_accepted].token_id == drafts[num_accepted]:
            num_accepted += 1
        if num_accepted:
            first = attrs.evolve(first, following=tuple(tokens[offset + 1:offset + 1 + num_accepted]))
        out[row.request_id] = first
        offset += 1 + len(drafts)
    if offset != len(tokens):
        raise ValueError(f"{len(tokens)} sampled positions for rows that have {offset}")
    return out
