"""InferRequest: one sequence's state as the scheduler tracks it (KsanaLLM's name, vLLM's field vocabulary)."""

from __future__ import annotations

import enum

import attrs

from ksana.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's maximum length
    ABORT = "abort"  # the client went away or cancelled
    ERROR = "error"  # rejected: queue full, waiting timeout, prompt too long


@attrs.define(eq=False)
class InferRequest:
    """A request from arrival to finish; owned by the scheduler once sent in ``AddRequest``.

    ``token_ids`` is the prompt followed by the generated tokens; ``num_computed_tokens`` of them have their K/V in
    the cache. A recompute preemption resets ``num_computed_tokens`` to 0 and keeps the generated tokens, so the
    request resumes by prefilling prompt + output (the generated tokens are never sampled twice).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    arrival_time: float = 0.0
    eos_token_ids: tuple[int, ...] = ()
    max_token_len: int = 1 << 30  # the hard cap on prompt + output
    token_ids: list[int] = attrs.field(init=False)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None

    def __attrs_post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_tokens_to_compute(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def stop_reason_after(self, token_id: int) -> FinishReason | None:
        """The finish reason once ``token_id`` has been appended, or None to go on."""
        params = self.sampling_params
        num_output = self.num_output_tokens
        if num_output >= params.min_tokens:
            if token_id in params.stop_token_ids:
                return FinishReason.STOP
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return FinishReason.STOP
        if params.max_tokens is not None and num_output >= params.max_tokens:
            return FinishReason.LENGTH
        if self.num_tokens >= self.max_token_len:
            return FinishReason.LENGTH
        return None

    def banned_token_ids(self) -> tuple[int, ...]:
        """Tokens that may not be sampled yet: EOS and stop tokens before ``min_tokens`` outputs."""
        params = self.sampling_params
        if self.num_output_tokens >= params.min_tokens:
            return ()
        eos = () if params.ignore_eos else self.eos_token_ids
        return tuple(eos) + tuple(params.stop_token_ids)
