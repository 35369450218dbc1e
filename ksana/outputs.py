"""RequestOutput / CompletionOutput: what ``LLM.generate`` returns (vLLM's shapes and names)."""

from __future__ import annotations

import attrs


@attrs.define
class CompletionOutput:
    """One generated sequence. ``logprobs`` (when asked) holds per token ``{token_id: logprob}`` for the chosen
    token and the top-n; ``token_logprobs`` always holds the chosen tokens' log-probabilities."""

    index: int
    text: str = ""
    token_ids: list[int] = attrs.field(factory=list)
    token_logprobs: list[float] = attrs.field(factory=list)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    error: str | None = None

    @property
    def cumulative_logprob(self) -> float:
        return float(sum(self.token_logprobs))

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@attrs.define
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(output.finished for output in self.outputs)
