"""Prompt logprobs: each prompt token's log-probability under the logits of the position before it.

Only the step that computes a prompt chunk has the hidden states those logits come from, so the worker computes
them there, for the rows that ask (``ScheduledRow.prompt_logprob_token_ids``), from the same ``compute_logits``
the sampler's logits come from (under tensor parallelism every rank runs it: the vocabulary gather is a
collective). Logprobs are raw (the log-softmax of the logits, as vLLM reports them); the logits go through
``CHUNK_TOKENS`` positions at a time, so a long prompt never holds its whole [tokens, vocab] float32 logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ksana.messages import PromptLogprobs, ScheduledRow

CHUNK_TOKENS = 512


def compute_prompt_logprobs(model, hidden: torch.Tensor, rows: Sequence[ScheduledRow],
                            query_starts: Sequence[int]) -> dict[str, PromptLogprobs]:
    """Per asking row: the logprobs of its ``prompt_logprob_token_ids``; ``hidden`` [T, H] holds the step's final
    hidden states, row i's from ``query_starts[i]`` on."""
    asked = [(i, row) for i, row in enumerate(rows) if row.prompt_logprob_token_ids]
    if not asked:
        return {}
    positions = [query_starts[i] + j for i, row in asked for j in range(len(row.prompt_logprob_token_ids))]
    targets = [t for _, row in asked for t in row.prompt_logprob_token_ids]
    num_top = max(row.num_prompt_top_logprobs for _, row in asked)
    device = hidden.device
    index = torch.tensor(positions, dtype=torch.long, device=device)
    target = torch.tensor(targets, dtype=torch.long, device=device)
    chosen, ranks, top_values, top_ids = [], [], [], []
    for start in range(0, len(positions), CHUNK_TOKENS):
        logprobs = torch.log_softmax(model.compute_logits(hidden[index[start:start + CHUNK_TOKENS]]), dim=-1)
        token_logprobs = logprobs.gather(1, target[start:start + CHUNK_TOKENS].unsqueeze(1))
        chosen.append(token_logprobs.squeeze(1))
        ranks.append((logprobs > token_logprobs).sum(dim=1) + 1)  # vLLM's rank: 1 + tokens more likely
        if num_top:
            values, ids = logprobs.topk(min(num_top, logprobs.shape[1]), dim=-1)  # sorted, largest first
            top_values.append(values)
            top_ids.append(ids)
    chosen_list = torch.cat(chosen).tolist()
    rank_list = torch.cat(ranks).tolist()
    values_list = torch.cat(top_values).tolist() if num_top else [[]] * len(positions)
    ids_list = torch.cat(top_ids).tolist() if num_top else [[]] * len(positions)

    out = {}
    offset = 0
    for _, row in asked:
        n, k = len(row.prompt_logprob_token_ids), row.num_prompt_top_logprobs
        span = slice(offset, offset + n)
        top = tuple(tuple(zip(ids[:k], values[:k], strict=True)) for ids, values in zip(ids_list[span],
                                                                                      values_list[span], strict=True))
        out[row.request_id] = PromptLogprobs(row.start_position + 1, tuple(chosen_list[span]), tuple(rank_list[span]),
                                             top)
        offset += n
    return out
