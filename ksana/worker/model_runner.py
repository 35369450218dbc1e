"""ModelRunner: turns a step plan into batch tensors, runs the forward pass over the paged KV cache, samples.

It holds no global state (one instance per tensor-parallel rank later) and never blocks the event loop itself:
the worker actor calls ``execute`` from a thread.
"""

from __future__ import annotations

import time

import attrs
import torch

from events.messages import RemoteBlock, RemoteLoad, SampledToken, ScheduledRow, StepPlan, StepTimings
from ksana.cache.remote_loading import RemoteKVStore
from ksana.worker.attention_metadata import AttentionMetadata
from ksana.worker.kv_cache import KVCache
from ksana.worker.sampler import Sampler, SamplingRow


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, device: torch.device | str = "cpu") -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = torch.device(device)
        self.block_size = kv_cache.block_size
        self.sampler = Sampler()
        self.remote_store: RemoteKVStore | None = None

    def execute(self, plan: StepPlan) -> tuple[dict[str, SampledToken], StepTimings]:
        sampled, timings = self._execute_rows(plan) if plan.rows else ({}, StepTimings())
        if plan.remote_saves:
            self.save_remote_blocks(plan.remote_saves)
        return sampled, timings

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

    def save_remote_blocks(self, blocks: tuple[RemoteBlock, ...]) -> None:
        if self.remote_store is None:
            return
        for block in blocks:
            self.remote_store.save(block.block_hash, self.kv_cache.block_tensors(block.fa_block_id, block.swa_block_id))

    def _execute_rows(self, plan: StepPlan) -> tuple[dict[str, SampledToken], StepTimings]:
        t0 = time.perf_counter()
        # Decode rows first: attention batches them in one pass.
        rows = sorted(plan.rows, key=lambda row: row.num_new_tokens != 1)
        input_ids, positions, meta = self.prepare_inputs(rows)
        t1 = time.perf_counter()
        with torch.inference_mode():
            hidden = self.model(input_ids, positions, self.kv_cache.layers, meta)
            sample_rows = [i for i, row in enumerate(rows) if row.do_sample]
            if not sample_rows:
                return {}, StepTimings(prepare_s=t1 - t0, forward_s=time.perf_counter() - t1)
            last_index = meta.query_start_loc[1:][sample_rows] - 1
            logits = self.model.compute_logits(hidden[last_index])
            t2 = time.perf_counter()
            sampled = self.sample(logits, [rows[i] for i in sample_rows])
        t3 = time.perf_counter()
        return sampled, StepTimings(prepare_s=t1 - t0, forward_s=t2 - t1, sample_s=t3 - t2)

    def prepare_inputs(self, rows: list[ScheduledRow]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        block_size = self.block_size
        query_lens = [row.num_new_tokens for row in rows]
        seq_lens = [row.seq_len for row in rows]
        max_blocks = max(len(row.block_ids) for row in rows)
        tables = [list(row.block_ids) + [0] * (max_blocks - len(row.block_ids)) for row in rows]
        token_list = [token for row in rows for token in row.token_ids]

        input_ids = torch.tensor(token_list, dtype=torch.int64)
        query_lens_t = torch.tensor(query_lens, dtype=torch.int64)
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int64)
        block_tables = torch.tensor(tables, dtype=torch.int64)
        query_start_loc = torch.zeros(len(rows) + 1, dtype=torch.int64)
        torch.cumsum(query_lens_t, 0, out=query_start_loc[1:])

        # Position of every token: its row's first new position plus its offset inside the row.
        row_index = torch.repeat_interleave(torch.arange(len(rows)), query_lens_t)
        offsets = torch.arange(len(token_list)) - query_start_loc[:-1][row_index]
        positions = (seq_lens_t - query_lens_t)[row_index] + offsets
        slot_mapping = block_tables[row_index, positions // block_size] * block_size + positions % block_size

        num_decodes = 0
        while num_decodes < len(rows) and query_lens[num_decodes] == 1:
            num_decodes += 1
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(self.device),
            query_start_loc=query_start_loc.to(self.device),
            seq_lens=seq_lens_t.to(self.device),
            block_tables=block_tables.to(self.device),
            block_size=block_size,
            num_decodes=num_decodes,
            max_seq_len=max(seq_lens),
            query_lens_list=query_lens,
            seq_lens_list=seq_lens,
        )
        if self.kv_cache.num_swa_blocks:
            meta.swa = self._swa_metadata(rows, meta, row_index, positions)
        return input_ids.to(self.device), positions.to(self.device), meta

    def _swa_metadata(self, rows: list[ScheduledRow], meta: AttentionMetadata, row_index: torch.Tensor,
                      positions: torch.Tensor) -> AttentionMetadata:
        """The sliding layers' view: SWA block ids (positions outside the window are -1, read as block 0 and
        masked), same sequences and lengths."""
        block_size = self.block_size
        max_blocks = max(len(row.swa_block_ids) for row in rows)
        tables = [[max(b, 0) for b in row.swa_block_ids] + [0] * (max_blocks - len(row.swa_block_ids))
                  for row in rows]
        block_tables = torch.tensor(tables, dtype=torch.int64)
        slot_mapping = block_tables[row_index, positions // block_size] * block_size + positions % block_size
        return attrs.evolve(meta, slot_mapping=slot_mapping.to(self.device),
                            block_tables=block_tables.to(self.device), swa=None)

    def sample(self, logits: torch.Tensor, rows: list[ScheduledRow]) -> dict[str, SampledToken]:
        sampling_rows = [
            SamplingRow(
                params=row.sampling_params,
                seed=row.seed,
                num_output_tokens=row.num_output_tokens,
                prompt_token_ids=row.prompt_token_ids,
                output_token_ids=row.output_token_ids,
                banned_token_ids=row.banned_token_ids,
            )
            for row in rows
        ]
        out = self.sampler(logits, sampling_rows)
        return {
            row.request_id: SampledToken(out.token_ids[i], out.logprobs[i], out.top_logprobs[i])
            for i, row in enumerate(rows)
        }
