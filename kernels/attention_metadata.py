"""What one forward pass needs to know about the batch's sequences and their KV blocks.

Built by the model runner from the scheduler's step plan; read by every attention layer. Tokens of all
sequences are packed into one flat dimension (no padding); sequence i owns the query rows
``query_start_loc[i]:query_start_loc[i + 1]``.
"""

from __future__ import annotations

import attrs
import torch


@attrs.define
class AttentionMetadata:
    """Per-step batch layout for paged attention.

    - ``slot_mapping[t]``: the KV slot (``block_id * block_size + offset``) where token t's K/V are stored.
    - ``query_start_loc``: int64 [B + 1], prefix sums of the number of new tokens per sequence.
    - ``seq_lens``: int64 [B], each sequence's context length *including* this step's new tokens; its new
      tokens sit at positions ``seq_lens[i] - q_len_i .. seq_lens[i] - 1``.
    - ``block_tables``: int64 [B, max_blocks], the block ids of each sequence, padded with 0.
    - ``num_decodes``: the first ``num_decodes`` sequences have exactly one new token (decode rows are
      ordered first so attention can batch them); the rest are prefills or prefill chunks.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    block_size: int
    num_decodes: int
    max_seq_len: int
    # Python copies of the small per-sequence vectors, so attention loops do not sync on tensors.
    query_lens_list: list[int] = attrs.field(factory=list)
    seq_lens_list: list[int] = attrs.field(factory=list)
    # Sliding-window layers with their own SWA block pool read this instead (same layout, SWA block ids).
    swa: AttentionMetadata | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)
