"""ModelRunner: turns a step plan into batch tensors, runs the forward pass over the paged KV cache, samples.

It holds no global state (one instance per tensor-parallel rank later) and never blocks the event loop itself:
the worker actor calls ``execute`` from a thread.
"""

from __future__ import annotations

import time

import torch

from events.messages import SampledToken, ScheduledRow, StepPlan, StepTimings
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

    def execute(self, plan: StepPlan) -> tuple[dict[str, SampledToken], StepTimings]:
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
        return input_ids.to(self.device), positions.to(self.device), meta

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
