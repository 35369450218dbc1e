"""SamplingParams: how one request's tokens are chosen and when its generation stops (vLLM's field names)."""

from __future__ import annotations

import attrs

# vLLM bounds seeds to the signed 64-bit range; the sampler itself would take any integer.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names the parameter."""


def _check(condition: bool, name: str, message: str) -> None:
    if not condition:
        raise SamplingParamsError(f"sampling parameter '{name}' {message}")


@attrs.define(kw_only=True)
class SamplingParams:
    """Per-request decoding settings; ``temperature == 0`` means greedy."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = attrs.field(factory=list, converter=lambda s: [s] if isinstance(s, str) else list(s or []))
    stop_token_ids: list[int] = attrs.field(factory=list, converter=lambda s: list(s or []))
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per token besides the chosen one's; None: none
    # Logprobs of the prompt's tokens (``RequestOutput.prompt_logprobs``), with this many top alternatives each;
    # such a request computes its whole prompt (no prefix-cache hit), since a cached block's logits are gone.
    prompt_logprobs: int | None = None

    def __attrs_post_init__(self) -> None:
        _check(self.n >= 1, "n", f"must be at least 1, got {self.n}")
        _check(self.temperature >= 0.0, "temperature", f"must be non-negative, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= -1, "top_k", f"must be -1, 0 (off) or positive, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(self.repetition_penalty > 0.0, "repetition_penalty", f"must be positive, got {self.repetition_penalty}")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", f"must be at least 1, got {self.max_tokens}")
        _check(self.min_tokens >= 0, "min_tokens", f"must be non-negative, got {self.min_tokens}")
        _check(self.logprobs is None or self.logprobs >= 0, "logprobs", f"must be non-negative, got {self.logprobs}")
        _check(self.prompt_logprobs is None or self.prompt_logprobs >= 0, "prompt_logprobs",
               f"must be non-negative, got {self.prompt_logprobs}")
        _check(self.seed is None or SEED_MIN <= self.seed <= SEED_MAX, "seed",
               f"must be in [-2^63, 2^63 - 1] (a signed 64-bit integer), got {self.seed}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
