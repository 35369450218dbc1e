"""ModelRunner: turns a step plan into batch tensors, runs the forward pass over the paged KV cache, samples.

It holds no global state (one instance per tensor-parallel rank later) and never blocks the event loop itself:
the worker actor calls ``execute`` from a thread.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence

import attrs
import numpy as np
import torch

from ksana.cache.remote_loading import RemoteKVStore
from ksana.disagg.kv_connector import KVConnector
from ksana.kernels.attention_metadata import AttentionMetadata
from ksana.kernels.dispatch import get_ops
from ksana.messages import (
    PLACEHOLDER_TOKEN,
    KVArrived,
    KVInstall,
    KVSend,
    PromptLogprobs,
    RemoteBlock,
    RemoteLoad,
    SampledToken,
    ScheduledRow,
    StepPlan,
    StepTimings,
)
from ksana.worker.kv_cache import KVCache
from ksana.worker.mtp_drafter import MTPDrafter
from ksana.worker.prompt_logprobs import compute_prompt_logprobs
from ksana.worker.sampler import Sampler, SamplingRow, plain_greedy
from ksana.worker.verify import accept_drafts, position_rows


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, device: torch.device | str = "cpu") -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = torch.device(device)
        self.block_size = kv_cache.block_size
        self.sampler = Sampler(get_ops(self.device).greedy_logprobs)
        self.remote_store: RemoteKVStore | None = None
        self.kv_connector: KVConnector | None = None  # prefill/decode disaggregation: this node's KV transport
        # The token sampled for each row of the last step: a plan made while that step ran names them with
        # ``PLACEHOLDER_TOKEN``. Tensor-parallel ranks that do not sample are handed rank 0's.
        self.last_sampled: dict[str, int] = {}
        # Speculative decoding with the model's MTP modules; their cache layers follow the model's in the pool.
        self.mtp_drafter: MTPDrafter | None = None
        # Tensor parallelism: rank 0's sampled tokens on every rank, which all run the MTP modules' forward.
        self.share_sampled: Callable[[dict[str, SampledToken]], dict[str, SampledToken]] | None = None

    def execute(self, plan: StepPlan) -> tuple[dict[str, SampledToken], StepTimings, dict[str, PromptLogprobs]]:
        """The sampled token of each sampling row, the step's timings, and the prompt logprobs of the rows that
        ask for them."""
        started = time.monotonic()
        previous, self.last_sampled = self.last_sampled, {}
        if plan.kv_installs:
            self.install_kv(plan.kv_installs)
        sampled, timings, prompt_logprobs = (self._execute_rows(plan, previous) if plan.rows
                                             else ({}, StepTimings(), {}))
        if plan.kv_sends:
            self.send_kv(plan.kv_sends, sampled)
        if plan.remote_saves:
            self.save_remote_blocks(plan.remote_saves)
        self.last_sampled = {rid: token.token_id for rid, token in sampled.items()}
        return sampled, attrs.evolve(timings, started_at=started, finished_at=time.monotonic()), prompt_logprobs

    def load_remote_blocks(self, loads: tuple[RemoteLoad, ...]) -> dict[str, int]:
        """Copy each load's blocks from the store, in order; a load stops at its first missing or unreadable
        block, and the count of consecutive loaded blocks goes back to the cache manager."""
        result = {}
        for load in loads:
            num_loaded = 0
            for block in load.blocks:
                tensors = self.remote_store.load(block.block_hash) if self.remote_store is not None else None
                if tensors is None or not self.kv_cache.write_block(block.fa_block_id, block.swa_block_id, tensors):
                    break
                num_loaded += 1
            result[load.request_id] = num_loaded
        return result

    def install_kv(self, installs: tuple[KVInstall, ...]) -> None:
        """Decode node: received prompts' K/V into their requests' blocks, before the forward reads them."""
        for install in installs:
            # Rank 0 was told of the arrival, so its share is here; another rank's comes at about the same time.
            received = self.kv_connector.take(install.transfer_id, wait_s=self.kv_connector.expire_s)
            self.kv_cache.scatter_blocks(install.block_ids, install.num_tokens, received.payload,
                                         skip_blocks=install.num_cached_tokens // self.block_size)

    def send_kv(self, sends: tuple[KVSend, ...], sampled: dict[str, SampledToken]) -> None:
        """Prefill node: each prompt's K/V (copied out now, so its blocks can be freed) and first token, queued for
        the decode peer."""
        for send in sends:
            token = sampled.get(send.request_id)  # (a tensor-parallel rank other than 0 samples nothing)
            first_token, logprob = (token.token_id, token.logprob) if token is not None else (-1, 0.0)
            payload = self.kv_cache.gather_blocks(send.block_ids, send.num_tokens)
            self.kv_connector.send(send.comm_key, KVArrived(send.transfer_id, first_token, send.num_tokens, logprob),
                                   payload)

    def save_remote_blocks(self, blocks: tuple[RemoteBlock, ...]) -> None:
        if self.remote_store is None:
            return
        for block in blocks:
            self.remote_store.save(block.block_hash, self.kv_cache.block_tensors(block.fa_block_id, block.swa_block_id))

    def _execute_rows(self, plan: StepPlan, previous: dict[str, int],
                      ) -> tuple[dict[str, SampledToken], StepTimings, dict[str, PromptLogprobs]]:
        t0 = time.perf_counter()
        rows = plan.rows
        if any(row.num_new_tokens != 1 for row in rows):
            # Decode rows first: attention batches them in one pass (stable, so decodes keep the plan's order).
            rows = sorted(rows, key=lambda row: row.num_new_tokens != 1)
        input_ids, positions, meta = self.prepare_inputs(rows, previous if plan.has_placeholders else None)
        sample_rows = [i for i, row in enumerate(rows) if row.do_sample]
        # Each sampled row's last token (a verify row's drafts' positions too); an all-decode step samples every
        # row, so the hidden states as they are.
        last_index = None
        if len(sample_rows) != len(rows) or meta.num_decodes != len(rows):
            ends = list(itertools.accumulate(meta.query_lens_list))
            index = [ends[i] - 1 - k for i in sample_rows for k in range(rows[i].num_draft_tokens, -1, -1)]
            last_index = torch.tensor(index, dtype=torch.int64, device=self.device)
        kv_layers = self.kv_cache.layers
        if self.mtp_drafter is not None:
            kv_layers = kv_layers[:len(kv_layers) - len(self.mtp_drafter.kv_layers)]
        t1 = time.perf_counter()
        with torch.inference_mode():
            hidden = self.model(input_ids, positions, kv_layers, meta)
            prompt_logprobs = {}
            if any(row.prompt_logprob_token_ids for row in rows):
                starts = [0, *itertools.accumulate(meta.query_lens_list)]
                prompt_logprobs = compute_prompt_logprobs(self.model, hidden, rows, starts)
            sampled, t2 = self._sample_rows(rows, sample_rows, last_index, hidden, previous)
            t3 = time.perf_counter()
            draft_s = 0.0
            if self.mtp_drafter is not None:  # its cache covers every row's positions, sampled or not
                if self.share_sampled is not None:
                    sampled = self.share_sampled(sampled)
                drafts = self.mtp_drafter.propose(rows, hidden, sampled, self.prepare_inputs)
                sampled = {rid: attrs.evolve(token, draft_token_ids=drafts.get(rid, ()))
                           for rid, token in sampled.items()}
                draft_s = time.perf_counter() - t3
        timings = StepTimings(prepare_s=t1 - t0, forward_s=t2 - t1 + draft_s, sample_s=t3 - t2)
        return sampled, timings, prompt_logprobs

    def _sample_rows(self, rows: Sequence[ScheduledRow], sample_rows: list[int], last_index: torch.Tensor | None,
                     hidden: torch.Tensor, previous: dict[str, int]) -> tuple[dict[str, SampledToken], float]:
        """The sampled rows' tokens, and when their logits were ready (``time.perf_counter``)."""
        if not sample_rows:
            return {}, time.perf_counter()
        hidden_rows = hidden if last_index is None else hidden[last_index]
        rows_sampled = rows if last_index is None else [rows[i] for i in sample_rows]
        # Plain greedy rows straight from the lm_head where the kernels fuse the two (no [N, vocab] logits).
        greedy = (self.model.compute_greedy(hidden_rows)
                  if all(plain_greedy(row.sampling_params, row.banned_token_ids) for row in rows_sampled)
                  else None)
        if greedy is None:
            logits = self.model.compute_logits(hidden_rows)
            logits_ready = time.perf_counter()
            return self.sample(logits, rows_sampled, previous), logits_ready
        tokens = [SampledToken(token_id, logprob, None) for token_id, logprob in zip(*greedy, strict=True)]
        return accept_drafts(rows_sampled, tokens), time.perf_counter()

    def prepare_inputs(self, rows: Sequence[ScheduledRow], previous: dict[str, int] | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The step's flat token ids, positions and attention metadata, from the rows (decode rows first).
        ``previous``: the last step's sampled tokens, for the rows planned before it ended (placeholders).

        Built in numpy and wrapped with ``torch.from_numpy``: a step's vectors are small, and a numpy call costs
        about a microsecond where a torch op costs several, which at batch 16 is most of the preparation.
        """
        block_size = self.block_size
        num_rows = len(rows)
        query_lens = [row.num_new_tokens for row in rows]
        seq_lens = [row.start_position + n for row, n in zip(rows, query_lens, strict=True)]
        num_tokens = sum(query_lens)
        block_tables = _padded_table([row.block_ids for row in rows], num_rows)
        query_start_loc = np.zeros(num_rows + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        num_decodes = 0
        while num_decodes < num_rows and query_lens[num_decodes] == 1:
            num_decodes += 1

        if num_tokens == num_rows:  # all decodes: one token per row, at its last position
            input_ids = np.fromiter((row.token_ids[0] for row in rows), dtype=np.int64, count=num_rows)
            if previous is not None:
                _fill_placeholders(input_ids, rows, previous)
            positions = np.array(seq_lens, dtype=np.int64) - 1
            row_index = np.arange(num_rows)
        else:
            input_ids = np.fromiter(itertools.chain.from_iterable(row.token_ids for row in rows), dtype=np.int64,
                                    count=num_tokens)
            if previous is not None:  # a placeholder is a decode row's one token; decode rows come first
                _fill_placeholders(input_ids[:num_decodes], rows[:num_decodes], previous)
            # Position of every token: its row's first new position plus its offset inside the row.
            row_index = np.repeat(np.arange(num_rows), query_lens)
            starts = np.array([row.start_position for row in rows], dtype=np.int64)
            positions = np.arange(num_tokens, dtype=np.int64) + (starts - query_start_loc[:-1])[row_index]
        slot_mapping = block_tables[row_index, positions // block_size] * block_size + positions % block_size

        device = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping).to(device),
            query_start_loc=torch.from_numpy(query_start_loc).to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
            block_tables=torch.from_numpy(block_tables).to(device),
            block_size=block_size,
            num_decodes=num_decodes,
            max_seq_len=max(seq_lens),
            query_lens_list=query_lens,
            seq_lens_list=seq_lens,
        )
        if self.kv_cache.num_swa_blocks:
            meta.swa = self._swa_metadata(rows, meta, row_index, positions)
        return torch.from_numpy(input_ids).to(device), torch.from_numpy(positions).to(device), meta

    def _swa_metadata(self, rows: Sequence[ScheduledRow], meta: AttentionMetadata, row_index: np.ndarray,
                      positions: np.ndarray) -> AttentionMetadata:
        """The sliding layers' view: SWA block ids (positions outside the window are -1, read as block 0 and
        masked), same sequences and lengths."""
        block_size = self.block_size
        block_tables = _padded_table([row.swa_block_ids for row in rows], len(rows))
        np.maximum(block_tables, 0, out=block_tables)
        slot_mapping = block_tables[row_index, positions // block_size] * block_size + positions % block_size
        return attrs.evolve(meta, slot_mapping=torch.from_numpy(slot_mapping).to(self.device),
                            block_tables=torch.from_numpy(block_tables).to(self.device), swa=None)

    def sample(self, logits: torch.Tensor, rows: Sequence[ScheduledRow],
               previous: dict[str, int] | None = None) -> dict[str, SampledToken]:
        """``logits``: one row per sampled position (a verify row has ``1 + num_draft_tokens``)."""
        sampling_rows = [
            position
            for row in rows
            for position in position_rows(row, SamplingRow(
                params=row.sampling_params,
                seed=row.seed,
                num_output_tokens=row.num_output_tokens,
                prompt_token_ids=row.prompt_token_ids,
                output_token_ids=_filled_outputs(row, previous),
                banned_token_ids=row.banned_token_ids,
            ))
        ]
        out = self.sampler(logits, sampling_rows)
        tokens = [SampledToken(token_id, logprob, top)
                  for token_id, logprob, top in zip(out.token_ids, out.logprobs, out.top_logprobs, strict=True)]
        return accept_drafts(rows, tokens)


def _fill_placeholders(input_ids: np.ndarray, rows: Sequence[ScheduledRow], previous: dict[str, int]) -> None:
    """Single-token rows only (``input_ids[i]`` is row i's token)."""
    for i in np.flatnonzero(input_ids == PLACEHOLDER_TOKEN):
        rid = rows[i].request_id
        if rid not in previous:
            raise RuntimeError(f"request {rid}: its token is a placeholder, but the previous step did not sample it")
        input_ids[i] = previous[rid]


def _filled_outputs(row: ScheduledRow, previous: dict[str, int] | None) -> Sequence[int]:
    """The penalty inputs' output tokens, their pending last one filled in."""
    outputs = row.output_token_ids
    if outputs and outputs[-1] == PLACEHOLDER_TOKEN and previous is not None:
        return [*outputs[:-1], previous[row.request_id]]
    return outputs


def _padded_table(tables: Sequence[Sequence[int]], num_rows: int) -> np.ndarray:
    """int64 [num_rows, longest table], each row's block ids padded with 0."""
    width = max(map(len, tables))
    out = np.zeros((num_rows, width), dtype=np.int64)
    for i, table in enumerate(tables):
        out[i, : len(table)] = table
    return out
