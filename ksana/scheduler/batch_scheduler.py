"""BatchScheduler: continuous batching under a token budget; decides, never computes.

Each step is a ``{request: num_new_tokens}`` plan (vLLM v1 style, no prefill/decode phases): running requests
first, oldest first, then waiting requests FIFO until the first one that does not fit. Prefills are chunked to
``split_fuse_token_num``. When the KV pool cannot hold a running request's next tokens, the newest running request
is preempted by recompute: its blocks are released and it goes back to the front of the waiting queue with its
generated tokens kept.

The scheduler mirrors the cache manager's free-block count from the manager's replies, so it can plan a step that
fits and ask for all of the step's blocks in one exchange.

With the prefix cache (``enable_auto_prefix_cache``) the same exchange carries the cache's traffic: a request
holding no blocks asks to match its prefix and its ``num_computed_tokens`` then starts at the matched tokens (the
step's tokens shrink accordingly); every demand carries the tokens the manager has not seen, so it knows which
blocks the step fills. A request whose prefix is in the remote store spends one step loading it (the worker does
the transfer within that step's ``ExecuteStep``) and is matched again, with the load's result, the step after.

A plan takes effect when it is sent (``commit``, vLLM v1's ``update_after_schedule``): the requests' computed
tokens advance and each sampled row counts a pending token, so the next step can be planned before this one's
result is back (async scheduling). The result only fills the pending tokens in and applies the stop rules. A plan
made while a step is in flight never preempts: the scheduler then waits for the step, whose end may free blocks.

Prefill/decode disaggregation (``InferRequest.kv_transfer``): on a prefill node a request's step that samples its
first token also sends its prompt's K/V (``KVSend``); on a decode node a request waits outside the queues until its
K/V has arrived (``kv_arrived``, in either order), then takes the first token as its first output and queues with
the prompt counted as computed: its first step installs the K/V (``KVInstall``) and decodes.
"""

from __future__ import annotations

import collections
import logging

import attrs

from ksana.cache.direct_cache_manager import num_blocks_for
from ksana.config import BatchSchedulerSetting
from ksana.messages import (
    BlockDemand,
    KVArrived,
    KVInstall,
    KVSend,
    PromptLogprobs,
    RemoteBlock,
    RemoteLoad,
    RequestDelta,
    SampledToken,
    ScheduledRow,
    StepBlocks,
)
from ksana.request import FinishReason, InferRequest, RequestStatus
from ksana.spec.ngram import propose_ngram
from ksana.spec.stats import SpecDecodingStats

logger = logging.getLogger(__name__)


@attrs.define
class ScheduledRequest:
    """``do_sample``: the row reaches the end of the request's tokens, so its last position is sampled.
    ``sample_index``/``num_preemptions`` (set by ``commit``): where the sampled token goes, and the request's
    preemption count then, so a result that comes back after a preemption is recognised and dropped.
    ``draft_token_ids``: speculative tokens after the request's last one, counted in ``num_new_tokens``."""

    request: InferRequest
    num_new_tokens: int
    draft_token_ids: tuple[int, ...] = ()
    do_sample: bool = attrs.field(init=False)
    sample_index: int = attrs.field(init=False, default=-1)
    num_preemptions: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        req = self.request
        self.do_sample = req.num_computed_tokens + self.num_new_tokens - len(self.draft_token_ids) == req.num_tokens


@attrs.define
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = attrs.field(factory=list)
    preempted: list[InferRequest] = attrs.field(factory=list)
    rejected: list[RequestDelta] = attrs.field(factory=list)
    remote_loads: tuple[RemoteLoad, ...] = ()
    remote_saves: tuple[RemoteBlock, ...] = ()
    kv_installs: tuple[KVInstall, ...] = ()
    kv_sends: tuple[KVSend, ...] = ()
    num_new_blocks: int = 0  # blocks the plan needs beyond what its requests hold (from the scheduler's mirror)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@attrs.define
class SchedulerStats:
    num_steps: int = 0
    num_preemptions: int = 0
    num_rejected: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    spec: SpecDecodingStats = attrs.field(factory=SpecDecodingStats)


class BatchScheduler:
    """Waiting queue, running list and the step policy; the actor around it does the messaging."""

    def __init__(self, setting: BatchSchedulerSetting, block_size: int, num_total_blocks: int,
                 max_token_len: int, kv_wait_s: float = 30.0) -> None:
        self.setting = setting
        self.block_size = block_size
        self.num_total_blocks = num_total_blocks
        # Slots past a row's tokens that its step writes: the MTP modules draft that far (``MTPDrafter``).
        self.num_reserved_slots = setting.mtp_step_num
        # A request can never outgrow the whole pool, so a lone request always fits.
        self.max_token_len = min(max_token_len, num_total_blocks * block_size - self.num_reserved_slots)
        self.waiting: collections.deque[InferRequest] = collections.deque()
        self.running: list[InferRequest] = []
        self.requests: dict[str, InferRequest] = {}
        self.block_ids: dict[str, tuple[int, ...]] = {}
        self.swa_block_ids: dict[str, tuple[int, ...]] = {}
        self.num_free_blocks = num_total_blocks
        self.enable_prefix_cache = setting.enable_auto_prefix_cache
        self._num_tokens_sent: dict[str, int] = {}  # tokens the cache manager has seen, per request
        self._remote_loaded: dict[str, int] = {}  # finished remote loads, reported with the next demand
        # Decode node: requests waiting for their K/V by transfer id, and K/V that came before its request.
        self.kv_wait_s = kv_wait_s
        self.awaits_kv = False  # a decode node's (``build_scheduling`` sets it from the configuration)
        self.awaiting_kv: dict[int, InferRequest] = {}
        self._early_kv: dict[int, tuple[KVArrived, float]] = {}
        self.stats = SchedulerStats()

    # ---- arrivals and departures ------------------------------------------------------------------------------
    def add_request(self, request: InferRequest) -> RequestDelta | None:
        """Queue a request; a rejection comes back as a finished delta with the error."""
        error = None
        if request.request_id in self.requests:
            error = f"request id {request.request_id!r} is already in use"
        elif len(self.waiting) >= self.setting.max_waiting_queue_len:
            error = f"waiting queue is full ({self.setting.max_waiting_queue_len} requests); retry later"
        elif request.num_prompt_tokens == 0:
            error = "the prompt is empty"
        elif request.num_prompt_tokens >= self.max_token_len:
            error = (f"the prompt has {request.num_prompt_tokens} tokens; the maximum is {self.max_token_len - 1} "
                     f"(max_token_len {self.max_token_len})")
        if error is not None:
            self.stats.num_rejected += 1
            logger.info("request %s rejected: %s", request.request_id, error)
            return _finished_delta(request, FinishReason.ERROR, error)
        request.max_token_len = min(request.max_token_len, self.max_token_len)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        kv = request.kv_transfer
        if kv is not None and kv.role == "decode":
            early = self._early_kv.pop(kv.transfer_id, None)
            if early is not None:
                return self._take_first_token(request, early[0])
            self.awaiting_kv[kv.transfer_id] = request
            return None
        self.waiting.append(request)
        return None

    def kv_arrived(self, msg: KVArrived, now: float) -> RequestDelta | None:
        """A prompt's K/V and first token came (decode node): the first token's delta, once its request is here."""
        request = self.awaiting_kv.pop(msg.transfer_id, None)
        if request is None:
            self._early_kv[msg.transfer_id] = (msg, now)
            return None
        return self._take_first_token(request, msg)

    def expire_kv_waits(self, now: float) -> list[RequestDelta]:
        """End the requests whose K/V has not come within ``kv_wait_s`` (they hold no blocks) and forget K/V no
        request claimed."""
        for tid in [tid for tid, (_, at) in self._early_kv.items() if now - at > self.kv_wait_s]:
            del self._early_kv[tid]
        deltas = []
        for tid in [tid for tid, r in self.awaiting_kv.items() if now - r.arrival_time > self.kv_wait_s]:
            request = self.awaiting_kv.pop(tid)
            message = f"no KV cache came from the prefill node within {self.kv_wait_s:g} s"
            logger.info("request %s ended: %s", request.request_id, message)
            deltas.append(self._end_unscheduled(request, FinishReason.ERROR, message))
        return deltas

    def _take_first_token(self, request: InferRequest, msg: KVArrived) -> RequestDelta:
        if msg.error is not None:
            return self._end_unscheduled(request, FinishReason.ERROR, msg.error)
        if msg.num_tokens != request.num_prompt_tokens:
            return self._end_unscheduled(request, FinishReason.ERROR, (
                f"the prefill node sent the KV cache of {msg.num_tokens} tokens for a prompt of "
                f"{request.num_prompt_tokens}"))
        request.token_ids.append(msg.first_token)
        request.num_computed_tokens = request.num_prompt_tokens
        request.kv_install_pending = True
        reason = request.stop_reason_after(msg.first_token)
        if reason is not None:
            self.requests.pop(request.request_id)
            request.status = RequestStatus.FINISHED
            request.finish_reason = reason
            self.stats.num_finished += 1
        else:
            self.waiting.append(request)
        return RequestDelta(request_id=request.request_id, new_token_ids=(msg.first_token,),
                            new_logprobs=(msg.logprob,), new_top_logprobs=(None,),
                            finish_reason=reason.value if reason is not None else None,
                            num_prompt_tokens=request.num_prompt_tokens)

    def _end_unscheduled(self, request: InferRequest, reason: FinishReason, error: str) -> RequestDelta:
        self.requests.pop(request.request_id, None)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.stats.num_rejected += 1
        return _finished_delta(request, reason, error)

    def abort_request(self, request_id: str) -> InferRequest | None:
        """Remove a request wherever it is; returns it (its blocks must then be freed) or None if unknown."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        kv = request.kv_transfer
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif kv is not None and self.awaiting_kv.get(kv.transfer_id) is request:
            del self.awaiting_kv[kv.transfer_id]
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = FinishReason.ABORT
        self._forget_blocks(request)
        self.stats.num_aborted += 1
        return request

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- planning ---------------------------------------------------------------------------------------------
    def schedule(self, now: float, allow_preempt: bool = True) -> SchedulerOutput:
        """The next step's plan. ``allow_preempt=False`` (a step is in flight): a running request that does not
        fit ends the plan empty instead, with only its rejections; plan again once the step is back."""
        out = SchedulerOutput()
        self._reject_timed_out(now, out)
        budget = self.setting.max_step_tokens
        free = self.num_free_blocks
        chunk = self.setting.split_fuse_token_num or None

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.num_pending_tokens and request.will_stop_on_length:
                i += 1  # its step in flight is its last: nothing to compute for it
                continue
            num_new = min(request.num_tokens_to_compute, budget, chunk or budget)
            need = self._missing_blocks(request, request.num_computed_tokens + num_new)
            drafts = self._drafts(request, budget) if num_new == 1 else ()
            if drafts:  # verify them in this row where their blocks fit; else decode without them
                need_drafted = self._missing_blocks(request, request.num_computed_tokens + 1 + len(drafts))
                if need_drafted <= free:
                    num_new, need = 1 + len(drafts), need_drafted
                else:
                    drafts = ()
            if need > free and not allow_preempt:
                return SchedulerOutput(rejected=out.rejected)
            while need > free and self.running[-1] is not request:
                free += self._preempt(self.running[-1], out)
            if need > free:
                free += self._preempt(request, out)
                break
            free -= need
            out.num_new_blocks += need
            budget -= num_new
            out.scheduled.append(ScheduledRequest(request, num_new, drafts))
            i += 1

        while self.waiting and budget > 0 and len(self.running) < self.setting.max_batch_size:
            request = self.waiting[0]
            num_new = request.num_tokens_to_compute
            if chunk is not None:
                num_new = min(num_new, chunk, budget)
            elif num_new > budget and out.scheduled:
                break  # without chunking a prompt runs whole; it waits for a step of its own
            need = self._missing_blocks(request, request.num_computed_tokens + num_new)
            if need > free:
                break
            free -= need
            out.num_new_blocks += need
            budget -= num_new
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
        if out.scheduled:
            self.stats.num_steps += 1
        return out

    def needs_block_exchange(self, out: SchedulerOutput) -> bool:
        """Whether the plan must go through the cache manager. Without the prefix cache a plan whose requests
        all fit in the blocks they hold changes nothing there (most decode steps: a block lasts ``block_size``
        steps), so the exchange is skipped; with it, every step tells the manager which blocks became full."""
        return self.enable_prefix_cache or out.num_new_blocks > 0

    def block_demands(self, out: SchedulerOutput) -> tuple[BlockDemand, ...]:
        if not self.enable_prefix_cache:
            return tuple(
                BlockDemand(s.request.request_id,
                            s.request.num_computed_tokens + s.num_new_tokens + self.num_reserved_slots)
                for s in out.scheduled
            )
        demands = []
        for s in out.scheduled:
            req = s.request
            rid = req.request_id
            # A request that wants prompt logprobs computes its whole prompt: a cached block's logits are gone. A
            # received prompt's blocks are matched too, so that the cached ones are not written again.
            if ((req.num_computed_tokens == 0 or req.kv_install_pending) and rid not in self.block_ids
                    and not req.wants_prompt_logprobs):
                num_new = (req.num_tokens if req.kv_install_pending else s.num_new_tokens) + self.num_reserved_slots
                demands.append(BlockDemand(rid, num_new, tuple(req.token_ids), match_prefix=True,
                                           num_remote_loaded_blocks=self._remote_loaded.pop(rid, -1)))
            else:  # the tokens the manager has not seen; a pending one goes with a later demand
                sent = self._num_tokens_sent.get(rid, 0)
                demands.append(BlockDemand(rid, req.num_computed_tokens + s.num_new_tokens + self.num_reserved_slots,
                                           tuple(req.token_ids[sent:req.num_known_tokens])))
            self._num_tokens_sent[rid] = req.num_known_tokens
        return tuple(demands)

    def apply_blocks(self, out: SchedulerOutput, reply: StepBlocks) -> None:
        """Take the granted block tables; a refused request is preempted (the direct manager never refuses a
        plan made from an accurate mirror, a sharing manager may)."""
        self.num_free_blocks = reply.num_free_blocks
        self.block_ids.update(reply.block_tables)
        if reply.swa_block_tables:
            self.swa_block_ids.update(reply.swa_block_tables)
        for rid, num_cached in reply.num_cached_tokens.items():
            self._start_at_cached(out, rid, num_cached)
        out.remote_loads, out.remote_saves = reply.remote_loads, reply.remote_saves
        if not reply.refused and not reply.remote_loads:
            return
        refused = set(reply.refused)
        loading = {load.request_id for load in reply.remote_loads}
        kept = []
        for s in out.scheduled:
            if s.request.request_id in refused:
                self._preempt(s.request, out)
            elif s.request.request_id not in loading:  # a loading request stays running, computes next step
                kept.append(s)
        out.scheduled = kept

    def _start_at_cached(self, out: SchedulerOutput, request_id: str, num_cached: int) -> None:
        """A prefix hit: the request's computation starts after its matched tokens."""
        for s in out.scheduled:
            req = s.request
            if req.request_id == request_id and req.kv_install_pending:
                req.num_cached_tokens = num_cached  # the K/V came whole: the install skips the cached blocks
                return
            if req.request_id == request_id:
                req.num_computed_tokens = num_cached
                if req.num_output_tokens == 0:
                    req.num_cached_tokens = num_cached
                s.num_new_tokens = min(s.num_new_tokens, req.num_tokens - num_cached)
                s.do_sample = num_cached + s.num_new_tokens == req.num_tokens
                return

    def note_remote_loaded(self, remote_loaded: dict[str, int]) -> None:
        """The worker's remote-load results; each rides on its request's next demand."""
        for rid, num_loaded in remote_loaded.items():
            if rid in self.requests:
                self._remote_loaded[rid] = num_loaded

    def build_rows(self, out: SchedulerOutput) -> tuple[ScheduledRow, ...]:
        """The plan's rows, before ``commit``; a request with a pending token computes that one token."""
        rows = []
        for s in out.scheduled:
            req = s.request
            start = req.num_computed_tokens
            drafts = s.draft_token_ids
            tokens = tuple(req.token_ids[start:start + s.num_new_tokens - len(drafts)]) + drafts
            params = req.sampling_params
            sample = s.do_sample
            rows.append(ScheduledRow(
                request_id=req.request_id,
                token_ids=tokens,
                start_position=start,
                block_ids=self.block_ids[req.request_id],
                swa_block_ids=self.swa_block_ids.get(req.request_id, ()),
                do_sample=sample,
                sampling_params=params if sample else None,
                seed=req.seed,
                num_output_tokens=req.num_output_tokens,
                prompt_token_ids=req.prompt_token_ids if sample and params.has_penalties else (),
                output_token_ids=req.output_token_ids if sample and params.has_penalties else (),
                banned_token_ids=req.banned_token_ids() if sample else (),
                prompt_logprob_token_ids=req.prompt_logprob_token_ids(start, s.num_new_tokens),
                num_prompt_top_logprobs=params.prompt_logprobs or 0,
                num_draft_tokens=len(drafts),
                next_token_id=(req.token_ids[start + s.num_new_tokens]
                               if self.setting.mtp_step_num and not sample else -1),
            ))
        return tuple(rows)

    def kv_transfers(self, out: SchedulerOutput) -> None:
        """The plan's K/V traffic, before ``commit``: installs of received prompts (decode node) and sends of
        computed ones with their first token (prefill node)."""
        installs, sends = [], []
        for s in out.scheduled:
            req, kv = s.request, s.request.kv_transfer
            if kv is None:
                continue
            block_ids = self.block_ids[req.request_id]
            if req.kv_install_pending:
                installs.append(KVInstall(req.request_id, kv.transfer_id, block_ids, req.num_prompt_tokens,
                                          req.num_cached_tokens))
            elif kv.role == "prefill" and s.do_sample and req.num_output_tokens == 0:
                sends.append(KVSend(req.request_id, kv.comm_key, kv.transfer_id, block_ids, req.num_prompt_tokens))
        out.kv_installs, out.kv_sends = tuple(installs), tuple(sends)

    def commit(self, out: SchedulerOutput) -> None:
        """The plan is sent: its tokens count as computed, and each sampled row's token as pending. Drafts count
        once accepted (``update``)."""
        for s in out.scheduled:
            req = s.request
            req.kv_install_pending = False
            req.num_computed_tokens += s.num_new_tokens - len(s.draft_token_ids)
            s.num_preemptions = req.num_preemptions
            if s.do_sample:
                s.sample_index = req.append_pending_token()

    # ---- results ----------------------------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[str, SampledToken],
               prompt_logprobs: dict[str, PromptLogprobs] | None = None) -> tuple[list[RequestDelta], list[str]]:
        """Fill in each sampled row's token and apply the stop rules; returns the deltas and the ids whose blocks
        to free. Prompt logprobs are kept even from a step that ran before a preemption: they are the prompt's."""
        deltas: list[RequestDelta] = []
        finished: list[str] = []
        for s in out.scheduled:
            req = s.request
            part = prompt_logprobs.get(req.request_id) if prompt_logprobs else None
            if part is not None and req.status is not RequestStatus.FINISHED:
                req.add_prompt_logprobs(part)
            if not s.do_sample or req.status is not RequestStatus.RUNNING or req.num_preemptions != s.num_preemptions:
                continue  # nothing sampled, or aborted / preempted while the step ran: its token is dropped
            token = sampled[req.request_id]
            req.fill_pending_token(s.sample_index, token.token_id)
            reason = req.stop_reason_after(token.token_id, s.sample_index + 1)
            tokens = [token]
            if s.draft_token_ids:
                reason = self._take_verified(s, token, tokens, reason)
            req.draft_token_ids = token.draft_token_ids
            if reason is not None:
                self._finish(req, reason)
                finished.append(req.request_id)
            deltas.append(RequestDelta(
                request_id=req.request_id,
                new_token_ids=tuple(t.token_id for t in tokens),
                new_logprobs=tuple(t.logprob for t in tokens),
                new_top_logprobs=tuple(t.top_logprobs for t in tokens),
                finish_reason=reason.value if reason is not None else None,
                num_prompt_tokens=req.num_prompt_tokens,
                num_cached_tokens=req.num_cached_tokens,
                prompt_logprobs=req.take_prompt_logprobs(),
                num_draft_tokens=len(s.draft_token_ids),
                num_accepted_draft_tokens=len(token.following),
            ))
        return deltas, finished

    def _take_verified(self, s: ScheduledRequest, token: SampledToken, tokens: list[SampledToken],
                       reason: FinishReason | None) -> FinishReason | None:
        """A verify row's result: its accepted drafts' K/V counts as computed, and the tokens after its first are
        appended up to a stop. The rejected drafts' slots hold stale K/V past ``num_computed_tokens``, which the
        next steps overwrite before any attention reads them; their blocks stay with the request."""
        req = s.request
        following = token.following
        if len(following) > len(s.draft_token_ids):
            raise ValueError(f"request {req.request_id}: {len(following)} drafts accepted of "
                             f"{len(s.draft_token_ids)}")
        self.stats.spec.observe(len(s.draft_token_ids), len(following))
        req.num_computed_tokens += len(following)
        for more in following:
            if reason is not None:
                break
            req.token_ids.append(more.token_id)
            tokens.append(more)
            reason = req.stop_reason_after(more.token_id)
        return reason

    # ---- internals --------------------------------------------------------------------------------------------
    def _drafts(self, request: InferRequest, budget: int) -> tuple[int, ...]:
        """The drafts a decoding request verifies in its next row: the MTP modules' from its last step, or prompt
        lookup's, cut to the step's token budget and to the tokens the request may still produce (the row adds
        one token beyond its accepted drafts)."""
        setting = self.setting
        limit = min(setting.num_speculative_tokens, budget - 1, self.max_token_len - request.num_tokens - 1)
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            limit = min(limit, max_tokens - request.num_output_tokens - 1)
        if limit <= 0 or request.num_pending_tokens:
            return ()
        if setting.spec_max_batch_size and len(self.running) > setting.spec_max_batch_size:
            return ()
        if request.draft_token_ids or setting.mtp_step_num:  # the worker's (the MTP modules', the simulator's)
            return tuple(request.draft_token_ids[:limit])
        return tuple(propose_ngram(request.token_ids, limit, setting.prompt_lookup_min, setting.prompt_lookup_max))

    def _missing_blocks(self, request: InferRequest, num_tokens: int) -> int:
        have = len(self.block_ids.get(request.request_id, ()))
        return max(0, num_blocks_for(num_tokens + self.num_reserved_slots, self.block_size) - have)

    def _preempt(self, request: InferRequest, out: SchedulerOutput) -> int:
        """Recompute-preempt: back to the front of the waiting queue; returns the blocks it gives back."""
        self.running.remove(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.kv_install_pending = False  # it recomputes its prompt, the received K/V is not needed
        request.draft_token_ids = ()
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted.append(request)
        self.stats.num_preemptions += 1
        logger.info("request %s preempted (recompute), %d tokens to redo", request.request_id, request.num_tokens)
        return self._forget_blocks(request)

    def _forget_blocks(self, request: InferRequest) -> int:
        """Drops the request's blocks from the mirror (and its pending tokens: no step's result will fill them)."""
        request.drop_pending_tokens()
        rid = request.request_id
        if self.enable_prefix_cache:
            self.swa_block_ids.pop(rid, None)
            self._num_tokens_sent.pop(rid, None)
            self._remote_loaded.pop(rid, None)
        num = len(self.block_ids.pop(rid, ()))
        self.num_free_blocks += num
        return num

    def _finish(self, request: InferRequest, reason: FinishReason) -> None:
        self.running.remove(request)
        del self.requests[request.request_id]
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self._forget_blocks(request)
        self.stats.num_finished += 1

    def _reject_timed_out(self, now: float, out: SchedulerOutput) -> None:
        timeout = self.setting.waiting_timeout_in_ms / 1000.0
        expired = [r for r in self.waiting if r.first_scheduled_time is None and now - r.arrival_time > timeout]
        for request in expired:
            self.waiting.remove(request)
            del self.requests[request.request_id]
            request.status = RequestStatus.FINISHED
            request.finish_reason = FinishReason.ERROR
            self.stats.num_rejected += 1
            message = f"request waited longer than waiting_timeout_in_ms={self.setting.waiting_timeout_in_ms}"
            logger.info("request %s rejected: %s", request.request_id, message)
            out.rejected.append(_finished_delta(request, FinishReason.ERROR, message))


def _finished_delta(request: InferRequest, reason: FinishReason, error: str | None = None) -> RequestDelta:
    return RequestDelta(request_id=request.request_id, finish_reason=reason.value, error=error,
                        num_prompt_tokens=request.num_prompt_tokens)
