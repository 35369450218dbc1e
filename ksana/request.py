"""InferRequest: one sequence's state as the scheduler tracks it (KsanaLLM's name, vLLM's field vocabulary)."""

from __future__ import annotations

import enum

import attrs

from ksana.messages import PLACEHOLDER_TOKEN, KVTransfer, PromptLogprobs
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

    With async scheduling the last ``num_pending_tokens`` of ``token_ids`` are ``PLACEHOLDER_TOKEN``: sampled by a
    step still in flight, counted already (positions, output counts, length limits) and filled in by its result.
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
    num_pending_tokens: int = 0
    # Served by a prefill/decode pair: a prefill node computes the prompt and sends its K/V; a decode node waits
    # for that K/V and its first token, installs them and decodes on.
    kv_transfer: KVTransfer | None = None
    kv_install_pending: bool = False  # decode node: the K/V arrived, the next step installs it
    # ``sampling_params.prompt_logprobs``: gathered over the prompt's chunks, sent once with the first token.
    prompt_logprobs: PromptLogprobs | None = None
    prompt_logprobs_sent: bool = False
    # Drafts the worker proposed after the last step (the MTP modules', or the simulator's), verified next.
    draft_token_ids: tuple[int, ...] = ()

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

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids are known: all but the pending ones."""
        return len(self.token_ids) - self.num_pending_tokens

    def append_pending_token(self) -> int:
        """Count the token a step in flight samples; returns its index, for ``fill_pending_token``."""
        self.token_ids.append(PLACEHOLDER_TOKEN)
        self.num_pending_tokens += 1
        return len(self.token_ids) - 1

    def fill_pending_token(self, index: int, token_id: int) -> None:
        """The step's result: pending tokens are filled oldest first, so ``index`` is the first pending one."""
        assert index == self.num_known_tokens, f"request {self.request_id}: token {index} filled out of order"
        self.token_ids[index] = token_id
        self.num_pending_tokens -= 1

    def drop_pending_tokens(self) -> None:
        """Forget the tokens of steps still in flight (finished, preempted, aborted): their results are dropped."""
        if self.num_pending_tokens:
            del self.token_ids[-self.num_pending_tokens:]
            self.num_pending_tokens = 0

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling_params.prompt_logprobs is not None

    def prompt_logprob_token_ids(self, start: int, num_new_tokens: int) -> tuple[int, ...]:
        """The prompt tokens whose logprobs a row computing ``num_new_tokens`` tokens from ``start`` gives (the
        tokens after its positions, inside the prompt), or none when those are known already (a recompute)."""
        if not self.wants_prompt_logprobs or self.prompt_logprobs_sent:
            return ()
        end = min(start + num_new_tokens, self.num_prompt_tokens - 1)  # the last prompt token the row predicts
        known = self.prompt_logprobs.end_index if self.prompt_logprobs is not None else 1
        if end < known:
            return ()
        return tuple(self.prompt_token_ids[start + 1:end + 1])

    def add_prompt_logprobs(self, part: PromptLogprobs) -> None:
        self.prompt_logprobs = (self.prompt_logprobs or PromptLogprobs()).extended(part)

    def take_prompt_logprobs(self) -> PromptLogprobs | None:
        """The whole prompt's logprobs, once: when asked for and all computed (a 1-token prompt has none)."""
        if not self.wants_prompt_logprobs or self.prompt_logprobs_sent:
            return None
        gathered = self.prompt_logprobs or PromptLogprobs()
        if gathered.end_index < self.num_prompt_tokens:
            return None
        self.prompt_logprobs_sent = True
        return gathered

    @property
    def will_stop_on_length(self) -> bool:
        """Whether the tokens counted so far already reach a length limit: no further step is needed."""
        params = self.sampling_params
        return ((params.max_tokens is not None and self.num_output_tokens >= params.max_tokens)
                or self.num_tokens >= self.max_token_len)

    def stop_reason_after(self, token_id: int, num_tokens: int | None = None) -> FinishReason | None:
        """The finish reason once ``token_id`` has been appended, or None to go on. ``num_tokens``: the request's
        length with that token, when tokens of later steps in flight are counted beyond it."""
        params = self.sampling_params
        num_tokens = self.num_tokens if num_tokens is None else num_tokens
        num_output = num_tokens - self.num_prompt_tokens
        if num_output >= params.min_tokens:
            if token_id in params.stop_token_ids:
                return FinishReason.STOP
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return FinishReason.STOP
        if params.max_tokens is not None and num_output >= params.max_tokens:
            return FinishReason.LENGTH
        if num_tokens >= self.max_token_len:
            return FinishReason.LENGTH
        return None

    def banned_token_ids(self) -> tuple[int, ...]:
        """Tokens that may not be sampled yet: EOS and stop tokens before ``min_tokens`` outputs."""
        params = self.sampling_params
        if self.num_output_tokens >= params.min_tokens:
            return ()
        eos = () if params.ignore_eos else self.eos_token_ids
        return tuple(eos) + tuple(params.stop_token_ids)
