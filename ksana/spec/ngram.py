"""Prompt-lookup drafting: the sequence repeats itself, so what followed its last n tokens before may follow again.

Works for every model family and costs no forward pass: the proposal is a search over the request's own tokens
(prompt and output) on the scheduler's side. It pays on inputs that get quoted or edited (code, extraction,
summaries) and proposes nothing where no suffix recurs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: Sequence[int], num_draft_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``num_draft_tokens`` tokens that followed the most recent earlier occurrence of the sequence's last
    ``n`` tokens, for the longest ``n`` from ``max_n`` down to ``min_n`` that occurs; [] when none does."""
    num_tokens = len(token_ids)
    if num_draft_tokens <= 0 or num_tokens <= min_n:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
        # Every window that starts before the suffix itself; the latest match is the likeliest continuation.
        windows = sliding_window_view(tokens[:-1], n)
        matches = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if matches.size:
            start = int(matches[-1]) + n
            return tokens[start:start + num_draft_tokens].tolist()
    return []
