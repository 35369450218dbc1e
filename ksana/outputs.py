"""RequestOutput / CompletionOutput: what ``LLM.generate`` returns (vLLM's shapes and names)."""

from __future__ import annotations

from collections.abc import Callable

import attrs

from ksana.messages import PromptLogprobs


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


@attrs.frozen
class Logprob:
    """One token's log-probability (vLLM's ``Logprob``): ``rank`` 1 is the most likely token; ``decoded_token`` is
    its text (None without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@attrs.define
class RequestOutput:
    """``prompt_logprobs`` (when ``SamplingParams.prompt_logprobs`` asked): per prompt token, None for the first
    (nothing precedes it), then ``{token_id: Logprob}`` for the prompt's token and the top alternatives."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(output.finished for output in self.outputs)


def prompt_logprobs_output(logprobs: PromptLogprobs, prompt_token_ids: list[int],
                           decode: Callable[[int], str] | None = None) -> list[dict[int, Logprob] | None]:
    """vLLM's ``RequestOutput.prompt_logprobs`` from the engine's: the prompt's token first in each dict, then its
    top alternatives with their ranks."""
    out: list[dict[int, Logprob] | None] = [None]
    for i, (logprob, rank, top) in enumerate(zip(logprobs.logprobs, logprobs.ranks, logprobs.top_logprobs,
                                                 strict=True)):
        token_id = prompt_token_ids[logprobs.first_index + i]
        entry = {token_id: Logprob(logprob, rank, decode(token_id) if decode else None)}
        for top_rank, (top_id, top_logprob) in enumerate(top, start=1):
            if top_id not in entry:
                entry[top_id] = Logprob(top_logprob, top_rank, decode(top_id) if decode else None)
        out.append(entry)
    return out
