"""Sampler: turns one step's logits into tokens and logprobs, one row per request.

Greedy rows without penalties or bans (the common case) are one vectorised argmax (``fast_argmax``: torch's
``argmax`` over a row is a slow scalar loop on CPU, ~5x ``amax``) and one ``log_softmax``; the other rows go through
bans -> repetition penalty -> presence/frequency penalties -> (greedy argmax | temperature -> top-k -> top-p ->
min-p -> random draw). Each random draw uses its own generator seeded from (seed, num_output_tokens), so a
request's tokens do not depend on its batch neighbours, the batch order or a preemption.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Sequence

import attrs
import torch

from ksana.sampling_params import SamplingParams


@attrs.frozen
class SamplingRow:
    """What the sampler needs to know about one request for this step."""

    params: SamplingParams
    seed: int  # every request has one (the scheduler draws one when the user gave none)
    num_output_tokens: int  # tokens generated so far; with `seed` it seeds this draw's generator
    prompt_token_ids: Sequence[int]  # repetition penalty runs over prompt + output (HF semantics)
    output_token_ids: Sequence[int]  # presence/frequency penalties run over output only (OpenAI semantics)
    banned_token_ids: Sequence[int] = ()  # masked to -inf (min_tokens: EOS and stop ids before the minimum)

    @property
    def needs_processing(self) -> bool:
        """False for the fast path: greedy on the raw logits."""
        return not self.params.is_greedy or self.params.has_penalties or len(self.banned_token_ids) > 0


def plain_greedy(params: SamplingParams, banned_token_ids: Sequence[int]) -> bool:
    """Greedy on the raw logits and nothing else asked (no penalties, bans or top logprobs): the fast path, which a
    backend may take straight from the lm_head (``CausalLM.compute_greedy``)."""
    return params.is_greedy and not params.has_penalties and not banned_token_ids and params.logprobs is None


@attrs.frozen
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]  # log-probability of each chosen token under the raw logits
    top_logprobs: list[list[tuple[int, float]] | None]  # per row: top-`params.logprobs` pairs or None


def generator_seed(seed: int, num_output_tokens: int) -> int:
    """A 63-bit seed from (seed, num_output_tokens), the same in every process (unlike the salted `hash`)."""
    digest = hashlib.blake2b(f"{seed}:{num_output_tokens}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def fast_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a 2-D float tensor, the same indices (first maximum on ties, NaN counts as the
    maximum), in two vectorised passes on CPU: the max of each chunk of the row (``amax`` is vectorised where
    ``argmax`` is a scalar loop, ~5x slower over a vocabulary), then ``argmax`` over the chunk maxima (the first
    chunk holding the row's maximum, or its first NaN) and inside that chunk. The chunk is the largest power of
    two up to 1024 dividing the vocabulary; a vocabulary with none of at least 64 takes torch's ``argmax``."""
    num_rows, vocab_size = x.shape
    chunk = min(vocab_size & -vocab_size, 1024) if vocab_size else 0
    if chunk < 64 or vocab_size == chunk or x.device.type != "cpu" or not x.is_contiguous():
        return x.argmax(dim=-1)
    chunks = x.view(num_rows, vocab_size // chunk, chunk)
    first = chunks.amax(dim=-1).argmax(dim=-1)
    inner = chunks[torch.arange(num_rows), first].argmax(dim=-1)
    return first.mul_(chunk).add_(inner)


def _flat_index(per_row: Sequence[Sequence[int]], vocab_size: int, device: torch.device):
    """(row, token) index tensors for a ragged list of token lists, dropping ids outside the vocab like HF."""
    rows = torch.tensor(
        list(itertools.chain.from_iterable(itertools.repeat(i, len(ids)) for i, ids in enumerate(per_row))),
        dtype=torch.long,
    )
    tokens = torch.tensor(list(itertools.chain.from_iterable(per_row)), dtype=torch.long)
    keep = (tokens >= 0) & (tokens < vocab_size)
    return rows[keep].to(device), tokens[keep].to(device)


class Sampler:
    """Stateless; call it once per step with float32 logits [N, V] and N rows.

    ``greedy_logprobs`` (a backend's ``KernelOps.greedy_logprobs``) takes steps where every row is plain greedy
    and none asks for top logprobs: argmax and the chosen logprob in one native pass, no [N, V] log_softmax.
    """

    def __init__(self, greedy_logprobs: Callable[[torch.Tensor], tuple[list[int], list[float]] | None] | None = None):
        self.greedy_logprobs = greedy_logprobs

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits of shape {tuple(logits.shape)} do not match {len(rows)} rows")
        logits = logits.float()
        if self.greedy_logprobs is not None and all(plain_greedy(row.params, row.banned_token_ids) for row in rows):
            fast = self.greedy_logprobs(logits)
            if fast is not None:
                return SamplerOutput(token_ids=fast[0], logprobs=fast[1], top_logprobs=[None] * len(rows))
        # Raw logprobs (vLLM v1's default): what a greedy request reports equals HF's log_softmax of its logits.
        raw_logprobs = torch.log_softmax(logits, dim=-1)

        token_ids = fast_argmax(logits)  # the fast path for every row; processed rows overwrite theirs
        processed = [i for i, row in enumerate(rows) if row.needs_processing]
        if len(processed) == len(rows):
            token_ids = _sample_processed(logits, rows)
        elif processed:
            index = torch.tensor(processed, dtype=torch.long, device=logits.device)
            token_ids[index] = _sample_processed(logits[index], [rows[i] for i in processed])

        chosen_logprobs = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        return SamplerOutput(
            token_ids=token_ids.tolist(),
            logprobs=chosen_logprobs.tolist(),
            top_logprobs=_top_logprobs(raw_logprobs, rows),
        )


def _sample_processed(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Token ids for rows that need penalties, bans or a random draw; `logits` [M, V] is not modified."""
    x = logits.clone()
    num_rows, vocab_size = x.shape
    device = x.device

    if any(row.banned_token_ids for row in rows):
        r, t = _flat_index([row.banned_token_ids for row in rows], vocab_size, device)
        x[r, t] = float("-inf")

    _apply_repetition_penalty(x, rows)
    _apply_presence_frequency_penalties(x, rows)

    token_ids = torch.empty(num_rows, dtype=torch.long, device=device)
    greedy = [i for i, row in enumerate(rows) if row.params.is_greedy]
    sampled = [i for i, row in enumerate(rows) if not row.params.is_greedy]
    if greedy:
        index = torch.tensor(greedy, dtype=torch.long, device=device)
        token_ids[index] = fast_argmax(x[index])
    if len(sampled) == num_rows:
        return _sample_random(x, rows)
    if sampled:
        index = torch.tensor(sampled, dtype=torch.long, device=device)
        token_ids[index] = _sample_random(x[index], [rows[i] for i in sampled])
    return token_ids


def _sample_random(x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """One random draw per row: rows with only a temperature and top-p look for their nucleus among the
    ``NUCLEUS_CANDIDATES`` highest logits first (``_nucleus_draw``), the others and the rows whose nucleus is wider
    go through the full sort (``_truncated_probs``)."""
    token_ids = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    vocab_size = x.shape[1]
    nucleus = [i for i, row in enumerate(rows) if row.params.top_p < 1.0 and row.params.min_p == 0.0
               and not 0 < row.params.top_k < vocab_size] if vocab_size > NUCLEUS_CANDIDATES else []
    rest = sorted(set(range(len(rows))) - set(nucleus))
    if nucleus:
        index = torch.tensor(nucleus, dtype=torch.long, device=x.device)
        drawn, found = _nucleus_draw(x if len(nucleus) == len(rows) else x[index], [rows[i] for i in nucleus])
        token_ids[index[found]] = drawn[found]
        rest = sorted(rest + [nucleus[i] for i in (~found).nonzero().flatten().tolist()])
    if rest:
        index = torch.tensor(rest, dtype=torch.long, device=x.device)
        rest_rows = [rows[i] for i in rest]
        token_ids[index] = _draw(_truncated_probs(x[index], rest_rows), rest_rows)
    return token_ids


# The logits a top-p nucleus is looked for among before the full sort. At the temperatures generation configs
# set (0.2-0.7) a nucleus of p = 0.9 is a handful of tokens; 64 leaves room for flatter rows, and a topk of 64 is
# a small part of sorting a 49k vocabulary, which cost more than the forward pass at 32 rows (seen as TPOT under
# ``bench/vs_vllm.py``, whose client samples with the model's defaults).
NUCLEUS_CANDIDATES = 64


def _nucleus_draw(x: torch.Tensor, rows: Sequence[SamplingRow]) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p sampling (HF semantics: the smallest set of the most likely tokens whose mass reaches p) from the
    ``NUCLEUS_CANDIDATES`` highest logits, by ``_draw``'s exponential race over the candidates only: one Exp(1)
    draw per candidate rank from the row's seeded generator (independent of the values, so each token's chance is
    still its share of the nucleus; drawing over the whole vocabulary costs about a millisecond a row). Returns the
    tokens and, per row, whether its nucleus lay among the candidates (the others need the full sort)."""
    temperature = torch.tensor([row.params.temperature for row in rows], dtype=x.dtype, device=x.device)
    x = x / temperature.unsqueeze(1)
    logprobs, candidates = torch.log_softmax(x, dim=-1).topk(NUCLEUS_CANDIDATES, dim=-1)  # largest first
    probs = logprobs.exp()
    above = probs.cumsum(dim=-1) - probs  # the mass of the tokens more likely than each
    top_p = torch.tensor([row.params.top_p for row in rows], dtype=x.dtype, device=x.device).unsqueeze(1)
    keep = above < top_p
    keep[:, 0] = True  # always the most likely token
    found = (above[:, -1] + probs[:, -1]) >= top_p.squeeze(1)  # the candidates' mass reaches p
    noise = _noise(rows, NUCLEUS_CANDIDATES, x.dtype, x.device)
    choice = (probs.masked_fill(~keep, 0.0) / noise).argmax(dim=-1, keepdim=True)
    return candidates.gather(1, choice).squeeze(1), found


def _apply_repetition_penalty(x: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """HF's RepetitionPenaltyLogitsProcessor, in place: over prompt + output, at most once per token."""
    picked = [i for i, row in enumerate(rows) if row.params.repetition_penalty != 1.0]
    if not picked:
        return
    r, t = _flat_index(
        [list(itertools.chain(rows[i].prompt_token_ids, rows[i].output_token_ids)) for i in picked],
        x.shape[1],
        x.device,
    )
    r = torch.tensor(picked, dtype=torch.long, device=x.device)[r]
    penalty = torch.tensor([row.params.repetition_penalty for row in rows], dtype=x.dtype, device=x.device)[r]
    score = x[r, t]
    # Duplicated (row, token) pairs compute and write the same value, so the penalty still applies once.
    x[r, t] = torch.where(score < 0, score * penalty, score / penalty)


def _apply_presence_frequency_penalties(x: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """OpenAI's penalties, in place: subtract presence * (count > 0) + frequency * count over output tokens."""
    picked = [
        i
        for i, row in enumerate(rows)
        if row.params.presence_penalty != 0.0 or row.params.frequency_penalty != 0.0
    ]
    if not picked:
        return
    r, t = _flat_index([rows[i].output_token_ids for i in picked], x.shape[1], x.device)
    counts = torch.zeros(len(picked), x.shape[1], dtype=x.dtype, device=x.device)
    counts.index_put_((r, t), torch.ones_like(t, dtype=x.dtype), accumulate=True)
    presence = torch.tensor([rows[i].params.presence_penalty for i in picked], dtype=x.dtype, device=x.device)
    frequency = torch.tensor(
        [rows[i].params.frequency_penalty for i in picked], dtype=x.dtype, device=x.device
    )
    index = torch.tensor(picked, dtype=torch.long, device=x.device)
    x[index] -= presence.unsqueeze(1) * (counts > 0).to(x.dtype) + frequency.unsqueeze(1) * counts


def _truncated_probs(x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Temperature, then top-k, top-p (HF semantics: smallest set reaching p) and min-p; returns probabilities."""
    num_rows, vocab_size = x.shape
    device = x.device
    temperature = torch.tensor([row.params.temperature for row in rows], dtype=x.dtype, device=device)
    x = x / temperature.unsqueeze(1)

    top_k = [row.params.top_k if 0 < row.params.top_k < vocab_size else vocab_size for row in rows]
    top_p = [row.params.top_p for row in rows]
    if any(k < vocab_size for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_x, sorted_index = x.sort(dim=-1)  # ascending
        if any(k < vocab_size for k in top_k):
            kth = torch.tensor([vocab_size - k for k in top_k], dtype=torch.long, device=device)
            threshold = sorted_x.gather(1, kth.unsqueeze(1))  # ties with the k-th logit survive, as in HF
            sorted_x = sorted_x.masked_fill(sorted_x < threshold, float("-inf"))
        if any(p < 1.0 for p in top_p):
            cumulative = sorted_x.softmax(dim=-1).cumsum(dim=-1)
            p = torch.tensor(top_p, dtype=x.dtype, device=device)
            remove = cumulative <= (1.0 - p).unsqueeze(1)
            remove[:, -1] = False  # always keep the most likely token
            sorted_x = sorted_x.masked_fill(remove, float("-inf"))
        x = torch.empty_like(x).scatter_(1, sorted_index, sorted_x)

    probs = x.softmax(dim=-1)
    min_p = [row.params.min_p for row in rows]
    if any(m > 0.0 for m in min_p):
        scale = torch.tensor(min_p, dtype=x.dtype, device=device).unsqueeze(1)
        probs = probs.masked_fill(probs < scale * probs.max(dim=-1, keepdim=True).values, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _draw(probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """One draw per row by the exponential race argmax(p / Exp(1)), each row with its own seeded generator."""
    return fast_argmax(probs / _noise(rows, probs.shape[1], probs.dtype, probs.device))


def _noise(rows: Sequence[SamplingRow], size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Each row's ``size`` Exp(1) draws, from its own generator seeded by its seed and output index."""
    noise = torch.empty((len(rows), size), dtype=dtype, device=device)
    for i, row in enumerate(rows):
        generator = torch.Generator(device=device)
        generator.manual_seed(generator_seed(row.seed, row.num_output_tokens))
        noise[i].exponential_(generator=generator)
    # A zero draw would turn 0 / 0 into NaN, which argmax would pick.
    return noise.clamp_min_(torch.finfo(dtype).tiny)


def _top_logprobs(
    raw_logprobs: torch.Tensor, rows: Sequence[SamplingRow]
) -> list[list[tuple[int, float]] | None]:
    result: list[list[tuple[int, float]] | None] = [None] * len(rows)
    asked = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if not asked:
        return result
    num_top = min(max(rows[i].params.logprobs for i in asked), raw_logprobs.shape[1])
    index = torch.tensor(asked, dtype=torch.long, device=raw_logprobs.device)
    values, token_ids = raw_logprobs[index].topk(num_top, dim=-1)  # sorted, largest first
    values, token_ids = values.tolist(), token_ids.tolist()
    for j, i in enumerate(asked):
        n = rows[i].params.logprobs
        result[i] = list(zip(token_ids[j][:n], values[j][:n], strict=True))
    return result
