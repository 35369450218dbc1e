"""Turns the scheduler's token deltas into text: incremental detokenization and stop strings.

This is the text side of the engine (vLLM v1's output processor): the scheduler knows token-level stops (EOS,
stop tokens, lengths) and never sees text; a stop string is found here, the text is cut before it, and the I/O
actor aborts the request in the scheduler. Both the offline API and the server use it.
"""

from __future__ import annotations

import attrs

from ksana.detokenizer import IncrementalDetokenizer
from ksana.messages import PromptLogprobs, RequestDelta
from ksana.outputs import CompletionOutput
from ksana.sampling_params import SamplingParams
from ksana.stop_checker import StopChecker


@attrs.define
class SequenceStream:
    """One sequence's accumulated output; ``feed`` returns the text that may be shown now."""

    output: CompletionOutput
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    stop_checker: StopChecker | None
    num_text_sent: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # from the delta with the first token, when asked for

    @classmethod
    def create(cls, index: int, tokenizer, prompt_token_ids: list[int], params: SamplingParams,
               skip_special_tokens: bool = True) -> SequenceStream:
        return cls(
            output=CompletionOutput(index=index, logprobs=[] if params.logprobs is not None else None),
            params=params,
            detokenizer=(IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens=skip_special_tokens)
                         if tokenizer is not None else None),
            stop_checker=StopChecker(params.stop) if params.stop else None,
        )

    @property
    def text(self) -> str:
        return self.output.text

    def feed(self, delta: RequestDelta) -> tuple[str, bool]:
        """Apply a delta; returns (new visible text, stopped_by_string). Idempotent after the finish."""
        out = self.output
        if out.finished:
            return "", False
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        stopped = False
        for i, token_id in enumerate(delta.new_token_ids):
            out.token_ids.append(token_id)
            out.token_logprobs.append(delta.new_logprobs[i])
            if out.logprobs is not None:
                entry = {token_id: delta.new_logprobs[i]}
                top = delta.new_top_logprobs[i] if i < len(delta.new_top_logprobs) else None
                for tid, lp in top or ():
                    entry.setdefault(tid, lp)
                out.logprobs.append(entry)
            if self.detokenizer is None:
                continue
            new_text = self.detokenizer.append([token_id])
            full_text = self.detokenizer.text
            if self.stop_checker is not None and new_text:
                match = self.stop_checker.check(full_text, len(new_text))
                if match is not None:
                    out.text = full_text[:match.truncate_to]
                    out.finish_reason = "stop"
                    stopped = True
                    break
            out.text = full_text
        if delta.error is not None:
            out.error = delta.error
        if not stopped and delta.finish_reason is not None:
            if self.detokenizer is not None:
                self.detokenizer.flush()  # a character cut mid-way shows as U+FFFD, as decode() would
                out.text = self.detokenizer.text
            out.finish_reason = delta.finish_reason
        visible = len(out.text)
        if not out.finished and self.stop_checker is not None:
            visible = self.stop_checker.safe_prefix_len(out.text)
        new_visible = out.text[self.num_text_sent:visible]
        self.num_text_sent = max(self.num_text_sent, visible)
        return new_visible, stopped
