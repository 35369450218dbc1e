"""Stop strings: find where generation must stop in the output text, and how much of it is safe to stream.

As in vLLM and OpenAI, the stop string itself is cut from the output. Each check searches only the tail that could
hold a match overlapping the new characters, so a step costs O(len(new) + max stop length), not O(len(text)).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs


@attrs.frozen
class StopMatch:
    truncate_to: int  # keep text[:truncate_to]; the stop string starts there
    stop: str  # the stop string that matched


class StopChecker:
    """Holds one request's stop strings; empty strings are ignored (they would match everywhere)."""

    def __init__(self, stop: Sequence[str]):
        self.stop: list[str] = [s for s in dict.fromkeys(stop) if s]
        self.max_stop_len = max((len(s) for s in self.stop), default=0)

    def check(self, text: str, num_new_chars: int) -> StopMatch | None:
        """The earliest stop string in `text` that overlaps its last `num_new_chars` characters, if any.

        Matches lying wholly in older text are not reported: an earlier check saw them. On a tie in position
        the stop string listed first wins (the truncation is the same).
        """
        num_new_chars = min(num_new_chars, len(text))
        if num_new_chars <= 0 or not self.stop:
            return None
        best: StopMatch | None = None
        old_len = len(text) - num_new_chars
        for s in self.stop:
            # A match ending after old_len starts at or after old_len - len(s) + 1.
            start = text.find(s, max(0, old_len - len(s) + 1))
            if start != -1 and (best is None or start < best.truncate_to):
                best = StopMatch(truncate_to=start, stop=s)
        return best

    def safe_prefix_len(self, text: str) -> int:
        """How much of `text` can be streamed now: all but the longest suffix that begins some stop string.

        Call it on text that `check` found no stop in; only a genuine partial match is held back.
        """
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return len(text) - hold
