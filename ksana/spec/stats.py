"""How many draft tokens the model accepts: KsanaLLM's ``spec_draft_hit_num`` / ``spec_draft_token_num``, by
draft position, and the mean accepted length (tokens a request gains per verifying step)."""

from __future__ import annotations

from typing import Any

import attrs


@attrs.define
class SpecDecodingStats:
    """Counts over verify rows: each is one request's step that checked ``k`` drafts and accepted the first ``a``."""

    num_verify_rows: int = 0
    spec_draft_token_num: int = 0
    spec_draft_hit_num: int = 0
    # Index i: the drafts proposed / accepted at draft position i (0: the first token after the verified one).
    draft_tokens_by_position: list[int] = attrs.field(factory=list)
    hits_by_position: list[int] = attrs.field(factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        if num_draft_tokens <= 0:
            return
        self.num_verify_rows += 1
        self.spec_draft_token_num += num_draft_tokens
        self.spec_draft_hit_num += num_accepted
        missing = num_draft_tokens - len(self.draft_tokens_by_position)
        if missing > 0:
            self.draft_tokens_by_position.extend([0] * missing)
            self.hits_by_position.extend([0] * missing)
        for i in range(num_draft_tokens):
            self.draft_tokens_by_position[i] += 1
            self.hits_by_position[i] += i < num_accepted

    @property
    def acceptance_rate(self) -> float:
        return self.spec_draft_hit_num / self.spec_draft_token_num if self.spec_draft_token_num else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verify row: the accepted drafts plus the token the model adds after them."""
        return 1.0 + self.spec_draft_hit_num / self.num_verify_rows if self.num_verify_rows else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [h / n if n else 0.0 for h, n in zip(self.hits_by_position, self.draft_tokens_by_position,
                                                     strict=True)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_verify_rows": self.num_verify_rows,
            "spec_draft_token_num": self.spec_draft_token_num,
            "spec_draft_hit_num": self.spec_draft_hit_num,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "acceptance_by_position": [round(r, 4) for r in self.acceptance_by_position],
        }
