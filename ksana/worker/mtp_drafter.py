"""Drafting with the model's MTP modules (DeepSeek's multi-token prediction), after each step's forward pass.

An MTP module predicts the token after next: at position ``j`` it reads the token there and the main model's
final hidden state at ``j - 1``, runs one decoder block over its own KV cache layer and gives logits for position
``j + 1`` (``DeepseekV3ForCausalLM.mtp_forward``). Its cache must hold every position of a sequence, so each step
runs it one position after each of the step's verified positions: a prompt chunk's (the chunk's tokens shifted
by one, the token after the chunk at the end), a decode row's one, a verify row's verified and accepted ones
(the row's tokens shifted, then what the step sampled). The output at a row's last position gives the first
draft of the request's next step (the greedy token: drafts are single tokens, ``ksana/worker/verify.py``); each
further draft feeds the previous one and the module's own hidden state back in, one position further (with
several MTP modules, module ``j`` drafts token ``j``; with one, it is reused). These positions run past the
sequence's verified tokens, so the scheduler reserves ``mtp_step_num`` slots beyond each row
(``BatchScheduler``); a chained position's K/V is rewritten by the next step, which verifies that position.

Only the drafts' quality depends on the MTP cache: a prefix-cache hit or a received prompt's K/V leaves the
module's cache for those positions as another request (or nobody) wrote it, which may cost accepted drafts, never
correctness.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch

from ksana.kernels.attention_metadata import AttentionMetadata
from ksana.messages import SampledToken, ScheduledRow
from ksana.worker.sampler import fast_argmax

PrepareInputs = Callable[[Sequence[ScheduledRow]], tuple[torch.Tensor, torch.Tensor, AttentionMetadata]]


class MTPDrafter:
    """``kv_layers[j]``: MTP module j's cache layer; ``num_drafts``: drafts per request per step."""

    def __init__(self, model, kv_layers: Sequence[tuple[torch.Tensor, torch.Tensor]], num_drafts: int,
                 block_size: int) -> None:
        if model.num_mtp_layers < 1:
            raise ValueError("the model has no MTP modules to draft with")
        self.model = model
        self.kv_layers = list(kv_layers)
        self.num_drafts = num_drafts
        self.block_size = block_size

    def _module(self, step: int) -> int:
        return step if self.model.num_mtp_layers > 1 else 0

    def propose(self, rows: Sequence[ScheduledRow], hidden: torch.Tensor, sampled: dict[str, SampledToken],
                prepare_inputs: PrepareInputs) -> dict[str, tuple[int, ...]]:
        """Each sampled row's drafts for its next step. ``rows`` in the forward's order, ``hidden`` its final hidden
        states (row i's positions consecutive, in order)."""
        mtp_rows, hidden_index = [], []
        offset = 0
        for row in rows:
            tokens = self._shifted_tokens(row, sampled.get(row.request_id))
            # Positions past the request's blocks are left out, and then its drafts (the prefix cache grants a
            # new request's blocks for its tokens only, not the reserved slots).
            room = len(row.block_ids) * self.block_size - row.start_position - 1
            if room > 0 and tokens:
                mtp_rows.append(attrs.evolve(row, token_ids=tuple(tokens[:room]), start_position=row.start_position + 1,
                                             num_draft_tokens=0, do_sample=row.do_sample and len(tokens) <= room))
                hidden_index.append(range(offset, offset + min(len(tokens), room)))
            offset += row.num_new_tokens
        if not mtp_rows:
            return {}
        # One-token rows first, as attention batches them (``AttentionMetadata.num_decodes``).
        order = sorted(range(len(mtp_rows)), key=lambda i: mtp_rows[i].num_new_tokens != 1)
        mtp_rows = [mtp_rows[i] for i in order]
        index = torch.tensor([p for i in order for p in hidden_index[i]], dtype=torch.int64, device=hidden.device)
        input_ids, positions, meta = prepare_inputs(mtp_rows)
        out = self.model.mtp_forward(0, input_ids, positions, hidden.index_select(0, index), self.kv_layers[0], meta)

        drafting = [row for row in mtp_rows if row.do_sample]
        if not drafting:
            return {}
        ends, end = [], 0
        for row in mtp_rows:
            end += row.num_new_tokens
            if row.do_sample:
                ends.append(end - 1)
        last_hidden = out.index_select(0, torch.tensor(ends, dtype=torch.int64, device=out.device))
        drafts = {row.request_id: [] for row in drafting}
        for step in range(self.num_drafts):
            if step:
                # One more position per row, where the request's blocks reach it.
                keep = [i for i, row in enumerate(drafting) if row.seq_len < len(row.block_ids) * self.block_size]
                if not keep:
                    break
                drafting = [attrs.evolve(drafting[i], token_ids=(drafts[drafting[i].request_id][-1],),
                                         start_position=drafting[i].seq_len) for i in keep]
                last_hidden = last_hidden.index_select(0, torch.tensor(keep, dtype=torch.int64,
                                                                       device=last_hidden.device))
                input_ids, positions, meta = prepare_inputs(drafting)
                module = self._module(step)
                last_hidden = self.model.mtp_forward(module, input_ids, positions, last_hidden,
                                                     self.kv_layers[module], meta)
            tokens = fast_argmax(self.model.mtp_compute_logits(self._module(step), last_hidden)).tolist()
            for row, token in zip(drafting, tokens, strict=True):
                drafts[row.request_id].append(token)
        return {rid: tuple(tokens) for rid, tokens in drafts.items()}

    @staticmethod
    def _shifted_tokens(row: ScheduledRow, token: SampledToken | None) -> list[int]:
        """The MTP module's input tokens, one position after each of the row's verified positions."""
        verified = row.token_ids[:row.num_new_tokens - row.num_draft_tokens]
        if row.do_sample:
            if token is None:
                return []
            return [*verified[1:], token.token_id, *(t.token_id for t in token.following)]
        if row.next_token_id < 0:
            return []
        return [*verified[1:], row.next_token_id]
