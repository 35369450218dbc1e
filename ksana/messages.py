"""The engine's message vocabulary: every exchange between actors is one of these frozen attrs classes.

The loop routes by type, so each type has exactly one handling actor:
- scheduler: ``AddRequest``, ``AddRequests``, ``AbortRequest``, ``StepResult``;
- cache manager: ``AllocateStepBlocks`` (request/reply), ``FreeRequestBlocks``, ``GetCacheStats`` (request/reply);
- worker: ``ExecuteStep``;
- scheduler, from the worker actor on a decode node (prefill/decode disaggregation): ``KVArrived``;
- I/O actor (or ModelPerfBackend, or the simulator's workload replayer): ``TokensOut``.
A step costs a constant number of messages whatever the batch size: one ``ExecuteStep``, one ``StepResult``, one
``TokensOut`` and at most one block exchange (none when the plan needs no new block and frees none; finished
requests are freed by the next exchange's ``release``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from ksana.request import InferRequest
    from ksana.sampling_params import SamplingParams


# ---- I/O actor -> scheduler -------------------------------------------------------------------------------------
@attrs.frozen
class AddRequest:
    """A new request; from here on the scheduler owns the ``InferRequest``."""

    request: InferRequest


@attrs.frozen
class AddRequests:
    """Several new requests at once: all are queued before the next step is planned, so they can share it
    (perf mode replays a fixed batch as exactly one step; one ``AddRequest`` each would start a step per arrival)."""

    requests: tuple[InferRequest, ...]


@attrs.frozen
class AbortRequest:
    """Stop a request (client gone, or a stop string matched on the text side); its blocks are freed."""

    request_id: str
    reason: str = "abort"  # "abort" or "stop"


# ---- scheduler -> I/O actor -------------------------------------------------------------------------------------
@attrs.frozen
class PromptLogprobs:
    """Log-probabilities of consecutive prompt tokens from ``first_index`` on (the prompt's first token has none:
    nothing precedes it). Per token: its logprob, its rank in the vocabulary (1: the most likely) and the top
    ``(token_id, logprob)`` alternatives, best first."""

    first_index: int = 1
    logprobs: tuple[float, ...] = ()
    ranks: tuple[int, ...] = ()
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()

    @property
    def end_index(self) -> int:
        """The index after the last token covered."""
        return self.first_index + len(self.logprobs)

    def extended(self, more: PromptLogprobs) -> PromptLogprobs:
        """These followed by the tokens of ``more`` past ``end_index`` (a recomputed prefix adds nothing);
        ``more`` must not start after ``end_index``."""
        if more.first_index > self.end_index:
            raise ValueError(f"prompt logprobs from token {more.first_index} do not follow those up to "
                             f"{self.end_index}")
        skip = self.end_index - more.first_index
        return PromptLogprobs(self.first_index, self.logprobs + more.logprobs[skip:], self.ranks + more.ranks[skip:],
                              self.top_logprobs + more.top_logprobs[skip:])


@attrs.frozen
class RequestDelta:
    """What one request produced in one step; ``finish_reason`` set means the request is over. The delta with a
    request's first token carries its ``prompt_logprobs`` when its parameters asked for them."""

    request_id: str
    new_token_ids: tuple[int, ...] = ()
    new_logprobs: tuple[float, ...] = ()
    new_top_logprobs: tuple[Any, ...] = ()  # per token: list[(token_id, logprob)] or None
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None
    # Speculative decoding: the drafts this step verified for the request and how many of them it accepted (the
    # accepted ones lead ``new_token_ids``).
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0


@attrs.frozen
class TokensOut:
    """All requests' deltas of one step (or one rejection), in one message."""

    deltas: tuple[RequestDelta, ...]
    time: float = 0.0
    num_running: int = 0  # the scheduler's queue sizes after this step, for the I/O side's metrics
    num_waiting: int = 0


# ---- scheduler <-> cache manager --------------------------------------------------------------------------------
@attrs.frozen
class BlockDemand:
    """Request ``request_id`` needs room for ``num_tokens`` tokens in total after this step.

    With the prefix cache, the demand also tells the cache manager which blocks are full after the step: its
    ``token_ids`` are the request's tokens the manager has not seen yet, and every block inside ``num_tokens`` is
    filled by the step. ``match_prefix`` marks a request holding no blocks (new or preempted): the manager matches
    its prefix first and ``num_tokens`` then counts from the matched tokens (the reply's ``num_cached_tokens``).
    ``num_remote_loaded_blocks`` (>= 0) reports the worker's result of this request's remote load.
    """

    request_id: str
    num_tokens: int
    token_ids: tuple[int, ...] = ()
    match_prefix: bool = False
    num_remote_loaded_blocks: int = -1


@attrs.frozen
class AllocateStepBlocks:
    """One exchange per step: free the ``release`` requests' blocks, then grow each demand in order.

    Demands are served in order and the first one that does not fit is refused together with all after it, so
    the scheduler's priority order holds.
    """

    demands: tuple[BlockDemand, ...]
    release: tuple[str, ...] = ()


@attrs.frozen
class StepBlocks:
    """The reply: the full block table of every granted demand, the refused ids, and what is left free."""

    block_tables: dict[str, tuple[int, ...]]
    refused: tuple[str, ...]
    num_free_blocks: int
    # Prefix cache only: per granted demand, its SWA block table (-1: outside the window, never read) ...
    swa_block_tables: dict[str, tuple[int, ...]] = attrs.field(factory=dict)
    # ... the matched tokens of each ``match_prefix`` demand (its ``num_computed_tokens`` starts there) ...
    num_cached_tokens: dict[str, int] = attrs.field(factory=dict)
    # ... requests that load remote blocks this step instead of computing, and blocks to write to the store.
    remote_loads: tuple[RemoteLoad, ...] = ()
    remote_saves: tuple[RemoteBlock, ...] = ()


@attrs.frozen
class RemoteBlock:
    """One block of the remote store: its hash-chain key and where its KV lives (-1: no SWA block)."""

    block_hash: int
    fa_block_id: int
    swa_block_id: int = -1


@attrs.frozen
class RemoteLoad:
    """Load ``blocks`` (consecutive prefix blocks) of ``request_id`` from the remote store into their blocks."""

    request_id: str
    blocks: tuple[RemoteBlock, ...]


# ---- prefill/decode disaggregation -----------------------------------------------------------------------------
@attrs.frozen
class KVTransfer:
    """A request one prefill/decode pair serves together: this node's ``role`` in it, the pair's ``comm_key``
    (``"<prefill addr>__<decode addr>"``) and the router's ``transfer_id`` (``kv-comm-request-id``), which names
    the request on both nodes."""

    role: str  # "prefill" or "decode"
    comm_key: str
    transfer_id: int


@attrs.frozen
class KVSend:
    """Prefill node, after the forward: send the prompt's K/V (``num_tokens`` positions in ``block_ids``, the last
    block partial) and the sampled first token to the decode peer."""

    request_id: str
    comm_key: str
    transfer_id: int
    block_ids: tuple[int, ...]
    num_tokens: int


@attrs.frozen
class KVInstall:
    """Decode node, before the forward: copy a received prompt's K/V into the request's ``block_ids``, but for the
    first ``num_cached_tokens // block_size`` blocks, which this node's prefix cache already holds (and may share
    with running requests)."""

    request_id: str
    transfer_id: int
    block_ids: tuple[int, ...]
    num_tokens: int
    num_cached_tokens: int = 0


@attrs.frozen
class KVArrived:
    """A prompt's K/V and first token came from the prefill peer (held by the worker's connector until
    installed)."""

    transfer_id: int
    first_token: int
    num_tokens: int
    logprob: float = 0.0  # the first token's
    error: str | None = None  # the K/V came but cannot be used (it does not fit this node's cache)


@attrs.frozen
class FreeRequestBlocks:
    """Finished or aborted requests whose blocks go back to the pool."""

    request_ids: tuple[str, ...]


@attrs.frozen
class GetCacheStats:
    """Ask the cache manager for its block counts."""


@attrs.frozen
class CacheStats:
    num_total_blocks: int
    num_free_blocks: int
    block_size: int
    num_requests_with_blocks: int
    # Prefix cache counters (KsanaLLM's metric names); zero without the cache.
    prefix_cache_hit_req_num: int = 0
    prefix_cache_hit_token_num: int = 0
    prefix_cache_hit_block_num: int = 0
    full_prompt_matched_req_num: int = 0
    num_cached_blocks: int = 0

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - self.num_free_blocks


# ---- scheduler <-> worker ---------------------------------------------------------------------------------------
# A token the scheduler does not know yet: the one the previous step samples for the same request. With async
# scheduling the next step is planned while that step runs, and the worker fills it in (``StepPlan.has_placeholders``).
PLACEHOLDER_TOKEN = -1


@attrs.frozen
class ScheduledRow:
    """One request's share of a step: compute ``token_ids`` at positions ``start_position...`` into its blocks.

    ``num_new_tokens`` may exceed 1 for a prefill chunk, and for a verify row: the request's last token followed
    by ``num_draft_tokens`` drafts, each of whose positions is sampled (and the drafts accepted while they match).
    When ``do_sample`` is set, the row's last position is sampled with the request's parameters; the penalty
    inputs (``prompt_token_ids``/``output_token_ids``) are only filled when a penalty needs them. A row planned
    while the step before it ran has ``PLACEHOLDER_TOKEN`` as its one token (and as the last output token).
    """

    request_id: str
    token_ids: tuple[int, ...]
    start_position: int
    block_ids: tuple[int, ...]
    do_sample: bool
    sampling_params: SamplingParams | None = None
    seed: int = 0
    num_output_tokens: int = 0
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    banned_token_ids: tuple[int, ...] = ()
    swa_block_ids: tuple[int, ...] = ()  # sliding-window layers' blocks (prefix cache on an SWA model)
    # Prompt logprobs: the prompt tokens at positions ``start_position + 1 ...``, which the row's first positions
    # predict (their logits are computed only here: a prefill chunk's hidden states are gone after its step), and
    # how many top alternatives each gets.
    prompt_logprob_token_ids: tuple[int, ...] = ()
    num_prompt_top_logprobs: int = 0
    num_draft_tokens: int = 0  # the last tokens of ``token_ids`` are drafts to verify
    # MTP drafting, a prompt chunk that does not reach the prompt's end: the token after its last.
    next_token_id: int = -1

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def draft_token_ids(self) -> tuple[int, ...]:
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens:]

    @property
    def seq_len(self) -> int:
        return self.start_position + len(self.token_ids)


@attrs.frozen
class StepPlan:
    step_id: int
    rows: tuple[ScheduledRow, ...]
    remote_loads: tuple[RemoteLoad, ...] = ()  # before the forward pass
    remote_saves: tuple[RemoteBlock, ...] = ()  # after it (the blocks this step fills)
    kv_installs: tuple[KVInstall, ...] = ()  # before the forward pass: received prompts' K/V
    kv_sends: tuple[KVSend, ...] = ()  # after it: prompts' K/V and first token to the decode peer
    # Some rows' token is ``PLACEHOLDER_TOKEN``: the worker takes it from what it sampled in the step before.
    has_placeholders: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(row.num_new_tokens for row in self.rows)


@attrs.frozen
class ExecuteStep:
    plan: StepPlan


@attrs.frozen
class SampledToken:
    """A row's sampled token. A verify row's is the token sampled at its first position, and ``following`` the
    tokens sampled after it while each one before matched its draft: ``(token, *following)`` are the row's new
    tokens, and ``len(following)`` is how many drafts it accepted."""

    token_id: int
    logprob: float
    top_logprobs: Any = None  # list[(token_id, logprob)] when asked
    following: tuple[SampledToken, ...] = ()
    draft_token_ids: tuple[int, ...] = ()  # the MTP modules' drafts for the request's next step


@attrs.frozen
class StepTimings:
    """Seconds spent in the worker, split so the perf mode and the trace can attribute them."""

    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    # When the worker's thread began and ended the step (``time.monotonic``, the wall clock's time base): with two
    # steps in flight the trace's message times no longer bracket a step, these do.
    started_at: float = 0.0
    finished_at: float = 0.0


@attrs.frozen
class StepResult:
    step_id: int
    sampled: dict[str, SampledToken]
    timings: StepTimings = StepTimings()
    remote_loaded: dict[str, int] = attrs.field(factory=dict)  # per remote load: consecutive blocks loaded
    prompt_logprobs: dict[str, PromptLogprobs] = attrs.field(factory=dict)  # rows with prompt_logprob_token_ids
