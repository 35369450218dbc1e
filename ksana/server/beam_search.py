"""Beam search on the I/O side, with Hugging Face ``generate(num_beams=k, do_sample=False)``'s exact semantics.

Like vLLM's frontend beam search, the scheduler knows nothing of beams: each step asks the engine for every live
beam's next-token top log-probabilities (one 1-token request per beam; prefix caching will make those cheap) and
this module does the bookkeeping. The rules mirror ``transformers``' ``_beam_search``:

- each step keeps the best ``max(2, 1 + num_eos) * k`` continuations over all beams, ranked by the sum of raw
  log-probabilities;
- a continuation that ends with EOS (or reaches ``max_tokens``) is a finished hypothesis only if it ranks in the
  top ``k`` of those; its score is ``sum_logprobs / num_generated_tokens ** length_penalty`` (EOS counted);
- the ``k`` best unfinished continuations are the next beams;
- the ``k`` best finished hypotheses are kept; once there are ``k`` of them, search stops when the best running
  beam, scored at its current length (or at ``max_tokens`` with ``early_stopping="never"`` and a positive length
  penalty), cannot beat the worst kept one; ``early_stopping=True`` stops as soon as ``k`` are kept.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import attrs

TopLogprobs = list[tuple[int, float]]  # (token_id, logprob), best first
# Given the live beams (their generated tokens), the top ``num_top`` next-token logprobs of each, in order.
ExpandFn = Callable[[list[tuple[int, ...]], int], Awaitable[list[TopLogprobs]]]


@attrs.frozen
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never"
    min_tokens: int = 0
    num_return_sequences: int | None = None  # None: beam_width

    def __attrs_post_init__(self) -> None:
        if self.beam_width < 1:
            raise ValueError(f"beam width must be at least 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 1 <= self.num_returned <= self.beam_width:
            raise ValueError(f"num_return_sequences must be in [1, {self.beam_width}], got {self.num_returned}")

    @property
    def num_returned(self) -> int:
        return self.beam_width if self.num_return_sequences is None else self.num_return_sequences

    @property
    def num_candidates(self) -> int:
        """HF's ``beams_to_keep``: enough continuations that ``k`` stay unfinished even if ``k`` pick EOS."""
        return max(2, 1 + len(self.eos_token_ids)) * self.beam_width


@attrs.frozen
class Beam:
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]  # the chosen tokens' logprobs
    top_logprobs: tuple[TopLogprobs, ...]  # the alternatives seen at each position
    cumulative_logprob: float


@attrs.frozen
class BeamHypothesis:
    """A finished sequence: ``score`` is the length-penalised one HF returns as ``sequences_scores``."""

    beam: Beam
    score: float
    finish_reason: str  # "stop" (ended with EOS) or "length"

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.beam.token_ids


async def beam_search(params: BeamSearchParams, expand: ExpandFn) -> list[BeamHypothesis]:
    """Run the search; returns the best ``num_returned`` hypotheses, best first."""
    k = params.beam_width
    eos = params.eos_token_ids
    # With min_tokens, EOS may be in the top list and then be dropped, so ask for that many more.
    num_top = params.num_candidates + (len(eos) if params.min_tokens > 0 else 0)
    running = [Beam((), (), (), 0.0)]
    finished: list[BeamHypothesis] = []
    can_improve = True

    for step in range(params.max_tokens):
        num_generated = step + 1
        tops = await expand([beam.token_ids for beam in running], num_top)
        candidates: list[tuple[float, int, int, float, TopLogprobs]] = []
        for b, (beam, top) in enumerate(zip(running, tops, strict=True)):
            for token_id, logprob in top:
                if step < params.min_tokens and token_id in eos:
                    continue  # HF's MinNewTokensLength: EOS is -inf before the minimum
                candidates.append((beam.cumulative_logprob + logprob, b, token_id, logprob, top))
        # torch.topk over the flattened (beam, token) scores; ties (never seen in practice) go to the lower index.
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        candidates = candidates[: params.num_candidates]
        at_max_length = num_generated >= params.max_tokens
        beams_full = len(finished) == k and params.early_stopping is True

        next_running: list[Beam] = []
        for rank, (score, b, token_id, logprob, top) in enumerate(candidates):
            parent = running[b]
            beam = Beam(parent.token_ids + (token_id,), parent.logprobs + (logprob,),
                        parent.top_logprobs + (top,), score)
            hits_eos = token_id in eos
            if hits_eos or at_max_length:
                if rank < k and can_improve and not beams_full:
                    penalised = score / (num_generated ** params.length_penalty)
                    finished.append(BeamHypothesis(beam, penalised, "stop" if hits_eos else "length"))
            elif len(next_running) < k:
                next_running.append(beam)
        finished.sort(key=lambda h: -h.score)  # stable: an earlier hypothesis wins a tie, as in HF's merge
        del finished[k:]
        running = next_running

        if at_max_length or not running:
            break
        if len(finished) == k:
            if params.early_stopping is True:
                break
            length = (params.max_tokens if params.early_stopping == "never" and params.length_penalty > 0.0
                      else num_generated)
            best_possible = running[0].cumulative_logprob / (length ** params.length_penalty)
            can_improve = can_improve and best_possible > finished[-1].score
            if not can_improve:
                break
    return finished[: params.num_returned]
